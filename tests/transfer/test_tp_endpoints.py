"""Rank 0's TP sender and receiver (producer/tp_sender.py, consumer/tp_receiver.py) over the
follower ranks' endpoints (worker/tp_rank_side.py), in one process on the fake backend.

The followers' side channel is replaced by a direct call through pickle (what the pipe
does); everything else is the real code: each rank's endpoint over its own pool shard,
the plan of who sends which heads, combining the ranks' outcomes. The live clusters in
tests/e2e/test_pd_tp.py run the same code across processes over ucx and ipc.
"""

from __future__ import annotations

import dataclasses
import pickle
import time
from typing import Any

import pytest
import torch

from consumer.tp_receiver import TPReceiver
from engine.kv_layout import KVLayout
from producer.tp_sender import TPSender
from transfer import TransferConfig, TransferNotice, TransferStatus, make_receiver, make_sender
from worker.tp_endpoints import split_addresses
from worker.tp_rank_side import TransferRankSide

NB, BS, LAYERS, DIM = 16, 4, 2, 8
CFG = TransferConfig(backend="fake")
S = TransferStatus


class PipeFollowers:
    """Stands in for TPFollowers: side messages and reports cross a pickle, as in the pipe."""

    def __init__(self, sides: dict[int, TransferRankSide]) -> None:
        self.sides = sides
        self.sent: list[tuple[int, Any]] = []

    def side(self, rank: int, msg: Any) -> None:
        self.sent.append((rank, msg))
        self.sides[rank].on_message(pickle.loads(pickle.dumps(msg)))

    def reports(self) -> list[tuple[int, Any]]:
        return [(r, pickle.loads(pickle.dumps(rep)))
                for r, s in self.sides.items() for rep in s.poll()]


def _layout(heads: int, tp: int, rank: int) -> KVLayout:
    return KVLayout("tiny-tp", "float32", BS, LAYERS, heads, DIM, NB, tp_size=tp, tp_rank=rank)


def _args(kind: str, lay: KVLayout) -> dict[str, Any]:
    d = {k: v for k, v in dataclasses.asdict(lay).items() if k != "tp_rank"}
    return {"kind": kind, "layout": d, "transfer": dataclasses.asdict(CFG), "name": kind}


class Workers:
    """A producer of ``a`` ranks and a consumer of ``b``, as rank 0 of each sees them."""

    def __init__(self, a: int, b: int, heads: int) -> None:
        self.ref = torch.randn(NB, LAYERS, 2, BS, heads, DIM)
        src_lay = [_layout(heads, a, p) for p in range(a)]
        dst_lay = [_layout(heads, b, c) for c in range(b)]
        self.src = [self.ref[..., lay.head_start:lay.head_start + lay.head_count, :]
                    .contiguous() for lay in src_lay]
        self.dst = [torch.full((NB, *lay.block_shape), -1.0) for lay in dst_lay]
        self.psides = {p: TransferRankSide(self.src[p], p, _args("producer", src_lay[0]))
                       for p in range(1, a)}
        self.csides = {c: TransferRankSide(self.dst[c], c, _args("consumer", dst_lay[0]))
                       for c in range(1, b)}
        self.pf, self.cf = PipeFollowers(self.psides), PipeFollowers(self.csides)
        self.tx = TPSender(make_sender(self.src[0], src_lay[0], CFG), src_lay[0],
                           self.pf if a > 1 else None)  # type: ignore[arg-type]
        local_rx = make_receiver(self.dst[0], dst_lay[0], CFG)
        self.rx = local_rx if b == 1 else TPReceiver(
            local_rx, self.cf, [s.info() for _, s in sorted(self.csides.items())])  # type: ignore[arg-type]
        self.dst_lay = dst_lay

    def close(self) -> None:
        self.tx.close()
        self.rx.close()
        for s in [*self.psides.values(), *self.csides.values()]:
            s.close()


def _until(side: Any, rid: str, timeout: float = 10.0) -> Any:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        for u in side.poll():
            if u.request_id == rid:
                return u
        time.sleep(0.001)
    raise AssertionError(f"{rid}: not terminal")


@pytest.mark.parametrize("a,b,heads", [(2, 1, 2), (1, 2, 1), (2, 2, 1), (2, 4, 2), (4, 2, 4)])
def test_every_consumer_rank_gets_its_heads_and_both_sides_end_as_one(a, b, heads):
    w = Workers(a, b, heads)
    try:
        src, dst = list(range(3, 12)), list(range(5, 14))
        w.rx.expect("r1", dst, source_tp=a)
        if isinstance(w.rx, TPReceiver):
            assert w.rx.poll() == [] and w.rx.take_ready() == ["r1"]  # every rank expects it
            assert len(split_addresses(w.rx.address)) == b
        w.tx.connect(w.rx.address)
        for i in range(0, len(src), 4):  # chunk by chunk, as chunked prefill pushes
            w.tx.push("r1", w.rx.address, src[i:i + 4], dst[i:i + 4])
        notice = TransferNotice("r1", 42, False, 36, seed=7)
        w.tx.finish("r1", notice)
        up = _until(w.rx, "r1")
        assert (up.status, up.notice) == (S.DONE, notice)
        assert _until(w.tx, "r1").status == S.DONE
        for c, lay in enumerate(w.dst_lay):
            want = w.ref[..., lay.head_start:lay.head_start + lay.head_count, :]
            assert torch.equal(w.dst[c][dst], want[src]), c
            others = [i for i in range(NB) if i not in dst]
            assert bool((w.dst[c][others] == -1).all()), c  # nothing outside the reservation
        # /metrics' byte counters sum every rank's: each consumer rank's heads, once
        want_bytes = len(src) * LAYERS * 2 * BS * DIM * 4 * sum(
            lay.head_count for lay in w.dst_lay)
        w.tx.poll()  # the followers' latest counters arrive with their reports
        w.rx.poll()
        assert w.tx.stats().payload_bytes == want_bytes
        assert w.rx.stats().payload_bytes == want_bytes
        if a > 1:
            assert w.tx.local.stats().payload_bytes < want_bytes  # rank 0 alone is not all
        w.tx.release("r1")
        w.rx.release("r1")
        assert w.tx.accounting().transfers == 0 and w.rx.accounting().transfers == 0
        for s in [*w.psides.values(), *w.csides.values()]:
            assert s.side.accounting().transfers == 0
    finally:
        w.close()


def test_one_rank_failing_cancels_the_others_and_the_request_ends_once_all_did():
    w = Workers(2, 2, 2)
    try:
        w.rx.expect("r2", [1, 2, 3], source_tp=2)
        w.tx.connect(w.rx.address)
        w.tx.push("r2", w.rx.address, [0, 1, 2], [1, 2, 3])
        with pytest.raises(ValueError, match="not every rank"):
            w.tx.release("r2")
        w.csides[1].side.cancel("r2", "rank 1 gave up")  # consumer rank 1 ends alone
        up = _until(w.rx, "r2")
        assert up.status == S.CANCELLED and up.error.startswith("rank 1: ")
        # rank 0 was cancelled in turn: its record is terminal too, and the producer ends
        assert w.rx.receiver.status("r2").terminal
        assert _until(w.tx, "r2").status != S.DONE
        w.rx.release("r2")
        w.tx.release("r2")
        assert w.csides[1].side.accounting().transfers == 0
    finally:
        w.close()


def test_a_follower_that_cannot_reach_the_consumer_fails_the_request_not_the_rank():
    w = Workers(2, 1, 2)
    try:
        w.tx.connect(w.rx.address)  # rank 0 can; rank 1 is sent a bad address below
        w.rx.expect("r3", [4, 5], source_tp=2)
        w.tx._begin("r3", {0, 1})  # as push() does, with rank 1 given a dead address
        w.pf.side(1, ("push", "r3", ["fake://nobody"], [0, 1], [4, 5], None))
        w.tx.sender.push("r3", w.rx.address, [0, 1], [4, 5])
        up = _until(w.tx, "r3")
        assert up.status == S.FAILED and "rank 1: " in up.error
        w.tx.release("r3")
        # rank 1 serves the next request normally
        w.tx.cancel("r3")  # unknown now: a no-op
        w.rx.cancel("r3", "done")
        _until(w.rx, "r3")
        w.rx.release("r3")
        w.rx.expect("r4", [6], source_tp=2)
        w.tx.push("r4", w.rx.address, [2], [6])
        w.tx.finish("r4", TransferNotice("r4", 1, False, 4))
        assert _until(w.rx, "r4").status == S.DONE
    finally:
        w.close()
