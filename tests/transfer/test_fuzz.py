"""Hostile frames at a live receiver's KV port (and a live sender's connection): the I/O
thread survives, bad frames are counted, books stay whole, and a real transfer from a
legitimate peer still lands exactly."""

from __future__ import annotations

from collections.abc import Iterator

import msgpack
import pytest
import torch
from hostile import RawPeer, frame, plane_info, until
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from xfer_helpers import LAYOUT, Pair

from transfer import Accounting, TransferNotice, TransferStatus, wire

NB = LAYOUT.num_blocks
RIDS = st.text(alphabet="xyz", min_size=1, max_size=6)  # never a legitimate request's id
SCALARS = (st.none() | st.booleans() | st.integers(-(1 << 63), (1 << 64) - 1) | st.floats()
           | st.text(max_size=8) | st.binary(max_size=8))
VALUES = st.recursive(SCALARS, lambda c: st.lists(c, max_size=4)
                      | st.dictionaries(st.text(max_size=6), c, max_size=4), max_leaves=8)
FIELDS = ["rid", "runs", "total", "notice", "notice_sent_ns", "reason", "error", "msgs",
          "version", "backend", "layout", "fingerprint", "plane", "name", "token"]
VALID = [frame("PUSH", {"rid": "x", "runs": [[9, 1, 1, 1]]}), frame("PING", {}),
         frame("FINISH", {"rid": "x", "total": 1, "notice": ["x", 1, False, 3, None, None]}),
         frame("FINISH", {"rid": "x", "total": 1, "notice": ["x", 1, False, 3, None, None],
                          "notice_sent_ns": 1_700_000_000_000_000_000}),
         frame("CANCEL", {"rid": "x", "reason": "r"}),
         frame("BATCH", {"msgs": [["PING", {}], ["CANCEL", {"rid": "y", "reason": ""}]]})]

random_bytes = st.binary(max_size=96)
truncated = st.sampled_from(VALID).flatmap(
    lambda f: st.integers(0, len(f) - 1).map(lambda i: f[:i]))
mistyped = st.builds(lambda k, b: frame(k, b),
                     st.sampled_from([k.value for k in wire.Kind] + ["NOPE", ""]),
                     st.dictionaries(st.sampled_from(FIELDS), VALUES, max_size=5)) | \
    VALUES.map(lambda v: bytes(msgpack.packb(v, use_bin_type=True)))
junk = random_bytes | truncated | mistyped


def _structurally_bad(data: bytes) -> bool:
    try:
        wire.decode(data, wire.TO_CONSUMER)
    except wire.MalformedMessage:
        return True
    return False


# runs that decode but lie outside the pools: refused by the handler's checks
bad_runs = st.tuples(st.integers(0, 1 << 40), st.integers(0, 1 << 40), st.integers(1, 1 << 40),
                     st.integers(0, 1 << 40)).filter(
    lambda r: r[1] + r[2] > NB or r[3] + r[2] > NB)


@pytest.fixture(params=["ucx", "ipc"])
def live(request: pytest.FixtureRequest) -> Iterator[Pair]:
    p = Pair(request.param)
    yield p
    p.close()


def _count(pair: Pair) -> int:
    return pair.rx.stats().malformed_messages


def _expect_count(pair: Pair, want: int) -> None:
    until(lambda: _count(pair) >= want, what=f"malformed_messages == {want}")
    assert _count(pair) == want


FUZZ = settings(max_examples=60, deadline=None, database=None,
                suppress_health_check=list(HealthCheck))


def test_fuzzed_frames_leave_the_kv_port_serving(live: Pair) -> None:
    pair = live
    pair.rx.expect("fuzz-held", [60, 61, 62])  # a reservation the fuzzing must not leak
    stranger = RawPeer(pair.addr)
    insider = RawPeer(pair.addr)
    plane, free_plane = plane_info(pair.backend)
    try:
        # 1. a connection that never passed the handshake: nothing it sends is read as more
        # than a HELLO, and every such frame is counted
        @FUZZ
        @given(data=junk | st.builds(lambda r: frame("PUSH", {"rid": r, "runs": [[1, 2, 1, 3]]}),
                                     RIDS))
        def unauthenticated(data: bytes) -> None:
            before = _count(pair)
            stranger.send(data)
            _expect_count(pair, before + 1)

        unauthenticated()
        # 2. a peer past the handshake sends mistyped, truncated and out-of-range messages
        assert insider.hello(pair.backend, plane)[0].KIND == wire.Kind.WELCOME

        @FUZZ
        @given(data=junk.filter(_structurally_bad))
        def malformed(data: bytes) -> None:
            before = _count(pair)
            insider.send(data)
            insider.send(frame("PING", {}))  # stays alive (bad frames do not count as heard)
            _expect_count(pair, before + 1)

        malformed()

        @FUZZ
        @given(rid=RIDS, run=bad_runs, tag=st.integers(1 << 40, (1 << 64) - 1))
        def out_of_range(rid: str, run: tuple[int, int, int, int], tag: int) -> None:
            before = _count(pair)
            insider.send(frame("PUSH", {"rid": rid, "runs": [[tag, *run[1:]]]}))
            insider.send(frame("PING", {}))
            _expect_count(pair, before + 1)

        out_of_range()
        # 3. a replayed push: the first is answered (unknown request), the replay refused
        push = frame("PUSH", {"rid": "zzz", "runs": [[(1 << 64) - 1, 1, 1, 1]]})
        before = _count(pair)
        insider.send(push)
        assert "unknown request" in insider.recv_kind(wire.Kind.ERROR).error  # type: ignore
        insider.send(push)
        _expect_count(pair, before + 1)
        # 4. more than one frame per message, and a frame over the size limit (libzmq
        # drops that connection before we see a byte of it)
        insider.send(frame("PING", {}), frame("PING", {}))
        _expect_count(pair, before + 2)
        stranger.send(b"\xc1" * (wire.MAX_FRAME_BYTES + 1))
        assert pair.rx.poll() == []  # the I/O thread is alive (poll raises if it died)
    finally:
        stranger.close()
        insider.close()
        free_plane()
    # the legitimate producer still moves exact bytes
    pair.rx.expect("legit", [5, 6, 7, 30])
    pair.tx.push("legit", pair.addr, [1, 2, 3, 9], [5, 6, 7, 30])
    pair.tx.finish("legit", TransferNotice("legit", 3, False, 64))
    got = pair.rx.wait("legit", 10)
    assert got.status == TransferStatus.DONE, got
    assert pair.tx.wait("legit", 10).status == TransferStatus.DONE
    for s, d in ((1, 5), (2, 6), (3, 7), (9, 30)):
        assert torch.equal(pair.dst[d], pair.src[s])
    assert bool((pair.dst[[60, 61, 62]] == -1).all())
    pair.rx.cancel("fuzz-held")
    assert pair.rx.wait("fuzz-held", 10).status == TransferStatus.CANCELLED
    for rid in ("legit", "fuzz-held"):
        pair.rx.release(rid)
    pair.tx.release("legit")
    # the insider goes silent and is dropped with whatever it left posted: books whole
    until(lambda: pair.rx.accounting() == Accounting(0, 0, 1), 10, "receiver books whole")
    assert pair.rx.stats().rejected_handshakes == 0


def _one_block_lands(pair: Pair, rid: str, src: int, dst: int) -> None:
    """A legitimate one-block transfer completes with exact bytes."""
    pair.rx.expect(rid, [dst])
    pair.tx.push(rid, pair.addr, [src], [dst])
    pair.tx.finish(rid, TransferNotice(rid, 1, False, 16))
    assert pair.rx.wait(rid, 10).status == TransferStatus.DONE
    assert torch.equal(pair.dst[dst], pair.src[src])


def test_the_c1_byte_that_killed_a_consumer_is_counted() -> None:
    for backend in ("ucx", "ipc"):
        pair = Pair(backend)
        raw = RawPeer(pair.addr)
        try:
            raw.send(b"\xc1")
            assert wire.decode(raw.recv()[-1], wire.TO_PRODUCER)[0].KIND == wire.Kind.REJECT
            assert pair.rx.stats().malformed_messages == 1
            assert pair.rx.poll() == []
            _one_block_lands(pair, "a", 4, 3)
        finally:
            raw.close()
            pair.close()


def test_a_stranger_hello_with_a_bad_token_learns_nothing_and_is_counted() -> None:
    from xfer_helpers import cfg, pool

    from transfer import make_receiver

    # curve off: the token travels in the HELLO (tests/transfer/test_curve.py: with CURVE a
    # stranger does not even get that far)
    rx = make_receiver(pool(fill=-1.0), LAYOUT, cfg("ucx", cluster_token="s3cret", curve=False))
    raw = RawPeer(rx.address)
    try:
        plane, free = plane_info("ucx")
        (rej,) = raw.hello("ucx", plane, token="guess")
        free()
        assert isinstance(rej, wire.Reject) and "cluster token" in rej.error
        assert "tiny" not in rej.error  # refused before the layout check names ours
        # not let in: its next frame is read as a HELLO attempt only
        raw.send(frame("PING", {}))
        until(lambda: rx.stats().malformed_messages == 1)
        assert rx.stats().rejected_handshakes == 1
        assert rx.accounting().peers == 0
    finally:
        raw.close()
        rx.close()


SENDER_JUNK = [b"\xc1", b"", frame("ACK", {"rid": 5}), frame("WELCOME", {"version": "2"}),
               frame("ERROR", {"rid": "r"}), frame("BATCH", {"msgs": [["BATCH", {}]]}),
               frame("PUSH", {"rid": "r", "runs": []})]


def test_a_hostile_consumer_cannot_kill_the_sender() -> None:
    from xfer_helpers import cfg, pool

    from transfer import make_sender

    tx = make_sender(pool(), LAYOUT, cfg("ucx"))
    consumer = RawPeer()
    plane, free = plane_info("ucx")
    try:
        tx.connect(consumer.address)
        ident, hello = consumer.recv()
        assert wire.decode_hello(hello).name == "producer"
        for i, data in enumerate(SENDER_JUNK):  # before the handshake's reply
            consumer.send(ident, data)
            until(lambda i=i: tx.stats().malformed_messages == i + 1)
        consumer.send(ident, frame("PING", {}))  # anything but WELCOME/REJECT first
        until(lambda: tx.stats().malformed_messages == len(SENDER_JUNK) + 1)
        consumer.send(ident, frame("WELCOME", consumer.welcome_body("ucx", plane)))
        until(lambda: tx.accounting().peers == 1)
        for i, data in enumerate(SENDER_JUNK):  # and after it
            consumer.send(ident, data)
            until(lambda i=i: tx.stats().malformed_messages == len(SENDER_JUNK) + 2 + i)
        consumer.send(ident, frame("WELCOME", consumer.welcome_body("ucx", plane)))  # again
        until(lambda: tx.stats().malformed_messages == 2 * len(SENDER_JUNK) + 2)
        assert tx.poll() == [] and tx.accounting().peers == 1
    finally:
        free()
        consumer.close()
        tx.close()



# b"\xff" * 300 is a UCX worker address that trips an assertion inside UCX (abort)
GARBAGE_PLANES = [b"", b"\x00", b"\xff" * 300, bytes(range(256)) * 4]


def test_data_plane_info_that_would_abort_ucx_is_refused_not_fatal() -> None:
    pair = Pair("ucx")  # no cluster token: any stranger reaches the data-plane info
    try:
        for plane in GARBAGE_PLANES:
            raw = RawPeer(pair.addr)
            try:
                (rej, *_) = raw.hello("ucx", plane)
                assert isinstance(rej, wire.Reject), rej
            finally:
                raw.close()
        assert pair.rx.stats().rejected_handshakes == len(GARBAGE_PLANES)
        assert pair.rx.accounting().peers == 1
        _one_block_lands(pair, "after", 13, 12)
    finally:
        pair.close()


def test_a_consumer_welcome_with_garbage_plane_info_fails_the_connect_only() -> None:
    from xfer_helpers import cfg, pool

    from transfer import make_sender

    tx = make_sender(pool(), LAYOUT, cfg("ucx"))
    consumer = RawPeer()
    try:
        for i, plane in enumerate(GARBAGE_PLANES[2:]):
            tx.connect(consumer.address)
            tx.push(f"g{i}", consumer.address, [1], [1])  # waits on the handshake
            ident, _ = consumer.recv()
            consumer.send(ident, frame("WELCOME", consumer.welcome_body("ucx", plane)))
            got = tx.wait(f"g{i}", 10)
            assert got.status == TransferStatus.FAILED, got
            assert "malformed" in (got.error or "") or "data-plane" in (got.error or ""), got
            assert tx.accounting().peers == 0
            tx.release(f"g{i}")
        assert tx.poll() == []
    finally:
        consumer.close()
        tx.close()
