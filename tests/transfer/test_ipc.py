"""What only the same-host pull plane (backend ipc) has: a shared producer pool, answers
before a cancelled producer lets go of its blocks, and a clear refusal across hosts."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
import torch
from xfer_helpers import LAYOUT, Pair, cfg, pool

from transfer import HandshakeError, TransferNotice, TransferStatus, make_receiver, make_sender

S = TransferStatus


@pytest.fixture
def ipc() -> Iterator[Pair]:
    p = Pair("ipc")
    yield p
    p.close()


def test_producer_writes_after_sharing_are_what_lands(ipc: Pair) -> None:
    # the producer's pool moved into shared memory when its sender started: the engine's
    # tensor must still be the memory that is read, not a stale copy
    assert ipc.src.untyped_storage().is_shared()
    ipc.src[7].fill_(3.5)
    ipc.rx.expect("w", [40])
    ipc.tx.push("w", ipc.addr, [7], [40])
    ipc.tx.finish("w", TransferNotice("w", 1, False, 0))
    assert ipc.rx.wait("w", 10).status == S.DONE
    assert bool((ipc.dst[40] == 3.5).all())


def test_producer_cancel_waits_for_consumer_answer_not_timeout(ipc: Pair) -> None:
    ipc.rx.expect("c", list(range(30, 38)))
    ipc.tx.push("c", ipc.addr, list(range(8)), list(range(30, 38)))
    t0 = time.monotonic()
    ipc.tx.cancel("c", "client went away")
    assert ipc.tx.wait("c", 10).status == S.CANCELLED
    # STOPPED came back: neither the peer timeout (2 s) nor a dropped connection ended it
    assert time.monotonic() - t0 < 1.5
    assert ipc.rx.wait("c", 10).status == S.CANCELLED
    assert ipc.tx.accounting().peers == 1
    ipc.rx.release("c")
    ipc.tx.release("c")
    # the connection still carries the next request
    ipc.rx.expect("n", [50])
    ipc.tx.push("n", ipc.addr, [2], [50])
    ipc.tx.finish("n", TransferNotice("n", 1, False, 0))
    assert ipc.rx.wait("n", 10).status == S.DONE
    assert torch.equal(ipc.dst[50], ipc.src[2])


def test_push_the_consumer_never_expected_fails_and_keeps_the_connection(ipc: Pair) -> None:
    ipc.tx.push("u", ipc.addr, [1], [1])  # the consumer answers ERROR, not silence
    got = ipc.tx.wait("u", 10)
    assert got.status == S.FAILED and "unknown request" in (got.error or "")
    assert ipc.tx.accounting().peers == 1


def test_different_host_is_refused_with_reason(monkeypatch: pytest.MonkeyPatch) -> None:
    import transfer.ipc_plane as ipc_plane

    monkeypatch.setattr(ipc_plane, "host_id", lambda: "another-host")
    rx = make_receiver(pool(fill=-1.0), LAYOUT, cfg("ipc"))
    monkeypatch.undo()
    tx = make_sender(pool(), LAYOUT, cfg("ipc"))
    try:
        with pytest.raises(HandshakeError, match="different hosts"):
            tx.connect(rx.address, timeout=10)
    finally:
        tx.close()
        rx.close()


def test_consumer_drops_one_of_two_producers_and_keeps_the_other() -> None:
    # two mapped pools: dropping one must not touch (or compare) the other's mapping
    rx = make_receiver(pool(fill=-1.0), LAYOUT, cfg("ipc"))
    srcs = [pool(), pool()]
    txs = [make_sender(s, LAYOUT, cfg("ipc"), name=f"p{i}") for i, s in enumerate(srcs)]
    try:
        for tx in txs:
            tx.connect(rx.address, timeout=10)
        txs[1].close()  # the later one goes silent: dropped after peer_timeout_s (2 s here)
        end = time.monotonic() + 10
        while rx.accounting().peers != 1:
            assert time.monotonic() < end, "the silent producer was never dropped"
            time.sleep(0.05)
        assert rx.poll() == []  # the I/O thread is alive (poll raises if it died)
        rx.expect("k", [9])
        txs[0].push("k", rx.address, [4], [9])
        txs[0].finish("k", TransferNotice("k", 1, False, 0))
        assert rx.wait("k", 10).status == S.DONE
        assert torch.equal(rx_pool_row(rx, 9), srcs[0][4])
    finally:
        for tx in txs:
            tx.close()
        rx.close()


def rx_pool_row(rx: object, block: int) -> torch.Tensor:
    return rx.pool.tensor[block]  # type: ignore[attr-defined]


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")  # on purpose
def test_a_dead_io_thread_makes_poll_raise_instead_of_going_quiet(ipc: Pair) -> None:
    ipc.rx.call(lambda: 1 / 0)  # type: ignore[attr-defined]  # any crash on the I/O thread
    end = time.monotonic() + 10
    while ipc.rx.error is None:  # type: ignore[attr-defined]
        assert time.monotonic() < end
        time.sleep(0.01)
    with pytest.raises(RuntimeError, match="I/O thread died"):
        ipc.rx.poll()


@pytest.mark.parametrize("claim", [
    {"size": 1 << 30, "offset": 0},  # a mapping past the file's end (SIGBUS on read)
    {"size": 4096, "offset": 0},  # the pool it claims does not fit the mapping
    {"size": 1 << 16, "offset": 1 << 15},  # the offset pushes the pool past the end
    {"nbytes": 100},  # not whole blocks
    {"fd": "3"},  # mistyped
    {},  # the control: a pool that fits is mapped
])
def test_a_producer_pool_that_does_not_fit_its_file_is_refused(claim: dict[str, object]) -> None:
    import os
    import tempfile

    import msgpack
    from hostile import RawPeer

    from transfer import wire
    from transfer.ipc_plane import host_id

    rx = make_receiver(pool(fill=-1.0), LAYOUT, cfg("ipc"))
    with tempfile.TemporaryFile() as f:
        f.truncate(1 << 16)  # a 64 KiB file: two blocks
        info = {"host": host_id(), "kind": "cpu", "pid": os.getpid(), "fd": f.fileno(),
                "size": 1 << 16, "offset": 0, "nbytes": 1 << 16,
                "block": LAYOUT.block_nbytes, **claim}
        raw = RawPeer(rx.address)
        try:
            (rej, *_) = raw.hello("ipc", bytes(msgpack.packb(info)))
            if not claim:
                assert rej.KIND == wire.Kind.WELCOME and rx.accounting().peers == 1
                return
            assert isinstance(rej, wire.Reject) and "backend ipc" in rej.error, rej
            assert rx.stats().rejected_handshakes == 1
            assert rx.accounting().peers == 0
        finally:
            raw.close()
            rx.close()
