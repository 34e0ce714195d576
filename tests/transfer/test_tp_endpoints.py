"""Rank 0's TP sender and receiver (transfer/tp_sender.py, transfer/tp_receiver.py) over
the follower ranks' endpoints (transfer/tp_rank_side.py), in one process on the fake backend.

The followers' rank channel is replaced by direct calls carrying the same encoded bytes
the pipe carries; everything else is the real code: each rank's endpoint started by its
factory over its own pool shard, the plan of who sends which heads, combining the ranks'
outcomes. The live clusters in tests/e2e/test_pd_tp.py run the same code across processes
over ucx and ipc.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import pytest
import torch
from pipe_followers import PipeFollowers
from xfer_helpers import until_terminal

from engine.kv_layout import KVLayout
from transfer import (
    TransferConfig,
    TransferNotice,
    TransferStatus,
    TransferUpdate,
    make_receiver,
    make_sender,
)
from transfer.tp_endpoints import split_addresses
from transfer.tp_messages import TO_RANK, PushCmd
from transfer.tp_receiver import TPReceiver, tp_receiver
from transfer.tp_sender import TPSender, tp_sender

NB, BS, LAYERS, DIM = 16, 4, 2, 8
CFG = TransferConfig(backend="fake")
S = TransferStatus


def _layout(heads: int, tp: int, rank: int) -> KVLayout:
    return KVLayout("tiny-tp", "float32", BS, LAYERS, heads, DIM, NB, tp_size=tp, tp_rank=rank)


class Workers:
    """A producer of ``a`` ranks and a consumer of ``b``, as rank 0 of each sees them."""

    def __init__(self, a: int, b: int, heads: int) -> None:
        self.ref = torch.randn(NB, LAYERS, 2, BS, heads, DIM)
        src_lay = [_layout(heads, a, p) for p in range(a)]
        dst_lay = [_layout(heads, b, c) for c in range(b)]
        self.src = [self.ref[..., lay.head_start:lay.head_start + lay.head_count, :]
                    .contiguous() for lay in src_lay]
        self.dst = [torch.full((NB, *lay.block_shape), -1.0) for lay in dst_lay]
        self.pf, self.cf = PipeFollowers(self.src), PipeFollowers(self.dst)
        self.tx: Any = tp_sender(make_sender(self.src[0], src_lay[0], CFG), src_lay[0], CFG,
                                 self.pf if a > 1 else None)
        assert isinstance(self.tx, TPSender)
        self.rx: Any = tp_receiver(make_receiver(self.dst[0], dst_lay[0], CFG), dst_lay[0],
                                   CFG, self.cf if b > 1 else None)
        self.psides, self.csides = self.pf.sides, self.cf.sides
        self.dst_lay = dst_lay

    def close(self) -> None:
        self.tx.close()
        self.rx.close()
        for s in [*self.psides.values(), *self.csides.values()]:
            s.close()


@pytest.mark.parametrize("a,b,heads", [(2, 1, 2), (1, 2, 1), (2, 2, 1), (2, 4, 2), (4, 2, 4)])
def test_every_consumer_rank_gets_its_heads_and_both_sides_end_as_one(a, b, heads):
    w = Workers(a, b, heads)
    try:
        src, dst = list(range(3, 12)), list(range(5, 14))
        w.rx.expect("r1", dst, source_tp=a)
        if isinstance(w.rx, TPReceiver):
            assert w.rx.take_ready() == []  # rank 0 holds the record, the followers' word
            assert w.rx.poll() == [] and w.rx.take_ready() == ["r1"]  # every rank expects it
            assert len(split_addresses(w.rx.address)) == b
        else:
            assert w.rx.take_ready() == ["r1"]  # one pool: ready once expect returns
        assert w.rx.take_ready() == []
        w.tx.connect(w.rx.address)
        for i in range(0, len(src), 4):  # chunk by chunk, as chunked prefill pushes
            w.tx.push("r1", w.rx.address, src[i:i + 4], dst[i:i + 4])
        notice = TransferNotice("r1", 42, False, 36, seed=7, sent_ns=time.time_ns())
        w.tx.finish("r1", notice)
        up = until_terminal(w.rx, "r1")
        assert (up.status, up.notice) == (S.DONE, notice)
        # the handoff's stamps, through every rank (a follower's in its UpdateReport)
        assert up.notice.sent_ns == notice.sent_ns
        assert notice.sent_ns <= up.notice_seen_ns <= up.kv_done_ns <= time.time_ns()
        assert until_terminal(w.tx, "r1").status == S.DONE
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
        up = until_terminal(w.rx, "r2")
        assert up.status == S.CANCELLED and up.error.startswith("rank 1: ")
        # rank 0 was cancelled in turn: its record is terminal too, and the producer ends
        assert w.rx.receiver.status("r2").terminal
        assert until_terminal(w.tx, "r2").status != S.DONE
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
        w.pf.side(1, TO_RANK.encode(PushCmd("r3", ("fake://nobody",), (0, 1), (4, 5), None)))
        w.tx.sender.push("r3", w.rx.address, [0, 1], [4, 5])
        up = until_terminal(w.tx, "r3")
        assert up.status == S.FAILED and "rank 1: " in up.error
        w.tx.release("r3")
        # rank 1 serves the next request normally
        w.tx.cancel("r3")  # unknown now: a no-op
        w.rx.cancel("r3", "done")
        until_terminal(w.rx, "r3")
        w.rx.release("r3")
        w.rx.expect("r4", [6], source_tp=2)
        w.tx.push("r4", w.rx.address, [2], [6])
        w.tx.finish("r4", TransferNotice("r4", 1, False, 4))
        assert until_terminal(w.rx, "r4").status == S.DONE
    finally:
        w.close()


def test_a_request_done_on_every_rank_takes_the_last_rank_s_stamps():
    # the KV is whole only once the last rank's part landed: each stamp is the latest rank's
    from transfer.tp_endpoints import _all_done

    n = TransferNotice("r", 1, False, 4)
    ups = [TransferUpdate("r", S.DONE, dataclasses.replace(n, sent_ns=sent), None, seen, done)
           for sent, seen, done in ((5, 7, 9), (6, 8, 8), (4, 10, 11))]
    got = _all_done(ups[0], ups)
    assert got.notice is not None and got.notice == n
    assert (got.notice.sent_ns, got.notice_seen_ns, got.kv_done_ns) == (6, 10, 11)
