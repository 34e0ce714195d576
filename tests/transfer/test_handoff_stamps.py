"""The P/D handoff's stamps on the KV wire and through real receivers: when the producer's
sender put the final notice on the wire (``TransferNotice.sent_ns``, beside the notice in
FINISH as the optional ``notice_sent_ns``), when the consumer's receiver read it and when
it knew every block had landed (``TransferUpdate.notice_seen_ns`` / ``kv_done_ns``)."""

from __future__ import annotations

import re
import time
from typing import Any

import msgpack
import pytest
import torch
from hostile import RawPeer, frame, plane_info, until
from xfer_helpers import LAYOUT, Pair, cfg, pool

from transfer import TransferNotice, TransferStatus, make_receiver, wire

S = TransferStatus


def _finish_body(**extra: Any) -> dict[str, Any]:
    return {"rid": "r", "total": 0, "notice": ["r", 7, False, 16, None, None], **extra}


def test_the_sent_stamp_travels_beside_the_notice_and_round_trips() -> None:
    n = TransferNotice("r", 7, False, 32, seed=3, sent_ns=1_700_000_000_123_456_789)
    (data,) = wire.encode([wire.Finish("r", 2, n)])
    kind, body = msgpack.unpackb(data, raw=False)
    assert kind == "FINISH" and body["notice_sent_ns"] == n.sent_ns
    # the notice keeps its six fields: a consumer of before the stamp checks their count
    # (and ignores a body key it does not know), so it still takes this FINISH
    assert len(body["notice"]) == 6
    (back,) = wire.decode(data, wire.TO_CONSUMER)
    assert isinstance(back, wire.Finish) and back == wire.Finish("r", 2, n)
    assert back.notice.sent_ns == n.sent_ns


def test_a_notice_without_the_stamp_still_works() -> None:
    # unstamped: no key, the frame is byte for byte what it was before the stamp existed
    (data,) = wire.encode([wire.Finish("r", 0, TransferNotice("r", 7, False, 16))])
    assert data == frame("FINISH", _finish_body())
    # a producer of before the stamp: the notice decodes with 0, "unknown"
    (m,) = wire.decode(frame("FINISH", _finish_body()), wire.TO_CONSUMER)
    assert isinstance(m, wire.Finish) and m.notice.sent_ns == 0


@pytest.mark.parametrize("bad,why", [
    ("soon", "expected int, got str"), (None, "expected int, got NoneType"),
    (True, "expected int, got bool"), (1.5, "expected int, got float"),
    ([1], "expected int, got list"), (-1, "-1 outside [0, "),
    (1 << 63, f"{1 << 63} outside [0, ")])
def test_a_bad_sent_stamp_is_refused_naming_the_field(bad: object, why: str) -> None:
    data = frame("FINISH", _finish_body(notice_sent_ns=bad))
    with pytest.raises(wire.MalformedMessage,
                       match="^" + re.escape(f"FINISH.notice_sent_ns: {why}")):
        wire.decode(data, wire.TO_CONSUMER)
    # inside a BATCH too (the usual frame of a turn's pushes and finish)
    batch = frame("BATCH", {"msgs": [["PING", {}], ["FINISH", _finish_body(notice_sent_ns=bad)]]})
    with pytest.raises(wire.MalformedMessage, match=r"FINISH\.notice_sent_ns"):
        wire.decode(batch, wire.TO_CONSUMER)


def test_the_stamp_is_no_part_of_the_notice_s_content() -> None:
    # producer ranks' notices must agree on token 0 (the receiver compares them), not on
    # the moment each rank let its notice go
    a = TransferNotice("r", 7, False, 32, sent_ns=1)
    b = TransferNotice("r", 7, False, 32, sent_ns=2)
    assert a == b and len({a, b}) == 1
    assert a != TransferNotice("r", 8, False, 32, sent_ns=1)


def test_a_receiver_stamps_reading_the_notice_and_the_kv_being_whole(pair: Pair) -> None:
    src, dst = list(range(3, 13)), list(range(20, 30))
    pair.rx.expect("r", dst)
    for i in range(0, 10, 4):  # chunk by chunk, as chunked prefill pushes
        pair.tx.push("r", pair.addr, src[i:i + 4], dst[i:i + 4])
    sent = time.time_ns()
    pair.tx.finish("r", TransferNotice("r", 42, False, 160, sent_ns=sent))
    got = pair.rx.wait("r", 10)
    assert got.status == S.DONE, got
    # the producer's, carried: a network sender's I/O thread stamps it again as the FINISH
    # leaves, so its own queue counts as the producer's part (the fake has no wire)
    assert got.notice is not None
    assert got.notice.sent_ns == sent if pair.backend == "fake" else sent < got.notice.sent_ns
    assert got.notice.sent_ns <= got.notice_seen_ns <= got.kv_done_ns <= time.time_ns()
    for s, d in zip(src, dst, strict=True):  # and DONE meant it: every block is there
        assert torch.equal(pair.dst[d], pair.src[s]), (s, d)
    tx = pair.tx.wait("r", 10)
    assert tx.status == S.DONE and (tx.notice_seen_ns, tx.kv_done_ns) == (0, 0)  # receiver's
    # a notice with no stamp (a producer of before it): the receiver's own stamps still come
    pair.rx.expect("u", [40])
    pair.tx.push("u", pair.addr, [1], [40])
    pair.tx.finish("u", TransferNotice("u", 1, False, 16))
    got = pair.rx.wait("u", 10)
    assert got.status == S.DONE and got.notice is not None and got.notice.sent_ns == 0
    assert 0 < got.notice_seen_ns <= got.kv_done_ns
    assert pair.tx.wait("u", 10).status == S.DONE
    for rid in ("r", "u"):
        pair.rx.release(rid)
        pair.tx.release(rid)


@pytest.mark.parametrize("backend", ["ucx", "ipc"])
def test_a_bad_stamp_at_the_kv_port_is_dropped_and_counted(backend: str) -> None:
    # from a peer past the handshake: the frame is dropped and counted, the I/O thread and
    # the request live on, and the peer's well-formed FINISH then ends it DONE
    rx = make_receiver(pool(fill=-1.0), LAYOUT, cfg(backend))
    raw = RawPeer(rx.address)
    plane, free = plane_info(backend)
    try:
        assert raw.hello(backend, plane)[0].KIND == wire.Kind.WELCOME
        rx.expect("r", [5])
        raw.send(frame("FINISH", _finish_body(notice_sent_ns="soon")))
        until(lambda: rx.stats().malformed_messages == 1, what="the bad FINISH counted")
        assert rx.poll() == [] and rx.status("r") == S.PENDING
        sent = time.time_ns()
        raw.send(frame("FINISH", _finish_body(notice_sent_ns=sent)))  # no runs: total 0
        got = rx.wait("r", 10)
        assert got.status == S.DONE and got.notice is not None
        assert got.notice.sent_ns == sent and sent <= got.notice_seen_ns <= got.kv_done_ns
        assert isinstance(raw.recv_kind(wire.Kind.ACK), wire.Ack)
        assert rx.stats().malformed_messages == 1
        rx.release("r")
    finally:
        raw.close()
        free()
        rx.close()
