"""KV transfer between workers of attention data-parallel groups (transfer/tp_groups.py):
rank 0's TP sender and receiver over the follower ranks' real endpoints, in one process
on the fake backend (the followers' rank channel is tests/transfer/pipe_followers.py).

A request's KV lives in one attention group's pools on the producer and is reserved in one
group's pools on the consumer. For every pair of groups, the consumer group's ranks must
end up holding exactly their heads of the producer group's KV, byte for byte; every other
rank of either worker must move no byte, hold no record, and (consumer) keep its pool
untouched; the address the consumer gives the producer names the group's ranks only.
The live clusters in tests/e2e/test_pd_dp_attention.py run the same code across processes.
"""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch
from pipe_followers import PipeFollowers
from xfer_helpers import until_terminal

from engine.kv_layout import KVLayout
from transfer import (
    KVReceiver,
    KVSender,
    TransferConfig,
    TransferNotice,
    TransferStatus,
    make_receiver,
    make_sender,
)
from transfer.tp_endpoints import split_addresses
from transfer.tp_groups import group_ranks
from transfer.tp_plan import parts_from
from transfer.tp_receiver import TPReceiver, tp_receiver
from transfer.tp_sender import TPSender, tp_sender

NB, BS, LAYERS, DIM = 16, 4, 2, 8
CFG = TransferConfig(backend="fake")
S = TransferStatus
# (producer ranks, its groups, consumer ranks, its groups, KV heads); 1 head is MLA's
# latent, whole on every rank of a group
CASES = [(2, 2, 2, 2, 1), (2, 1, 2, 2, 1), (2, 2, 2, 1, 1), (4, 2, 4, 2, 2), (4, 2, 2, 1, 2),
         (2, 1, 4, 2, 2), (2, 2, 1, 1, 1), (1, 1, 2, 2, 1)]


def _layout(heads: int, group_size: int, rank: int) -> KVLayout:
    return KVLayout("tiny-dp", "float32", BS, LAYERS, heads, DIM, NB, tp_size=group_size,
                    tp_rank=rank % group_size)


def _heads(kv: torch.Tensor, lay: KVLayout) -> torch.Tensor:
    return kv[..., lay.head_start:lay.head_start + lay.head_count, :]


class DPWorkers:
    """A producer of ``pt`` ranks in ``pd`` groups and a consumer of ``ct`` in ``cd``, as
    rank 0 of each sees them; ``groups`` says which groups hold a request (the engines'
    ``Request.dp_rank``)."""

    def __init__(self, pt: int, pd: int, ct: int, cd: int, heads: int) -> None:
        self.pt, self.pd, self.ct, self.cd = pt, pd, ct, cd
        self.pa, self.ca = pt // pd, ct // cd
        # each producer group's own full-head KV (the groups serve different requests)
        self.refs = [torch.randn(NB, LAYERS, 2, BS, heads, DIM) for _ in range(pd)]
        self.src_lay = [_layout(heads, self.pa, r) for r in range(pt)]
        self.dst_lay = [_layout(heads, self.ca, r) for r in range(ct)]
        self.src = [_heads(self.refs[r // self.pa], lay).contiguous()
                    for r, lay in enumerate(self.src_lay)]
        self.dst = [torch.full((NB, *lay.block_shape), -1.0) for lay in self.dst_lay]
        self.groups: dict[str, tuple[int, int]] = {}  # rid -> (producer group, consumer's)
        self.pf, self.cf = PipeFollowers(self.src), PipeFollowers(self.dst)
        self.tx: Any = tp_sender(make_sender(self.src[0], self.src_lay[0], CFG),
                                 self.src_lay[0], CFG, self.pf if pt > 1 else None,
                                 group_of=lambda rid: self.groups[rid][0])
        self.rx: Any = tp_receiver(make_receiver(self.dst[0], self.dst_lay[0], CFG),
                                   self.dst_lay[0], CFG, self.cf if ct > 1 else None,
                                   group_of=lambda rid: self.groups[rid][1])
        assert isinstance(self.tx, TPSender)
        assert isinstance(self.rx, TPReceiver) == (ct > 1)  # one rank: its own receiver

    def side(self, producer: bool, rank: int) -> KVSender | KVReceiver:
        if rank == 0:
            if producer:
                return self.tx.local
            return self.rx.local if isinstance(self.rx, TPReceiver) else self.rx
        return (self.pf if producer else self.cf).sides[rank].side

    def payload(self, producer: bool) -> list[int]:
        n = self.pt if producer else self.ct
        return [self.side(producer, r).stats().payload_bytes for r in range(n)]

    def records(self, producer: bool) -> list[int]:
        n = self.pt if producer else self.ct
        return [self.side(producer, r).accounting().transfers for r in range(n)]

    def close(self) -> None:
        self.tx.close()
        self.rx.close()
        for s in [*self.pf.sides.values(), *self.cf.sides.values()]:
            s.close()


def _ready(rx: Any, rid: str, timeout: float = 10.0) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        rx.poll()
        if rid in rx.take_ready():
            return
        time.sleep(0.001)
    raise AssertionError(f"{rid}: never ready")


@pytest.mark.parametrize("pt,pd,ct,cd,heads", CASES,
                         ids=[f"p{a}dp{b}-c{c}dp{d}-kv{h}" for a, b, c, d, h in CASES])
def test_kv_moves_between_the_two_groups_ranks_only(pt, pd, ct, cd, heads):
    w = DPWorkers(pt, pd, ct, cd, heads)
    try:
        all_addresses = split_addresses(w.rx.address)
        assert len(all_addresses) == ct  # registration still names every rank
        for gp in range(pd):
            for gc in range(cd):
                rid = f"g{gp}-{gc}"
                w.groups[rid] = (gp, gc)
                for pool in w.dst:
                    pool.fill_(-1.0)
                p_ranks, c_ranks = group_ranks(gp, w.pa, pt), group_ranks(gc, w.ca, ct)
                p_before, c_before = w.payload(True), w.payload(False)
                src, dst = list(range(3, 12)), list(range(5, 14))
                w.rx.expect(rid, dst, source_tp=w.pa)
                _ready(w.rx, rid)
                # only the consumer group's ranks hold a record; the address names them
                assert [n > 0 for n in w.records(False)] == \
                    [r in c_ranks for r in range(ct)], rid
                address = w.rx.address_for(rid)
                assert split_addresses(address) == [all_addresses[r] for r in c_ranks]
                w.tx.connect(address)
                for i in range(0, len(src), 4):  # chunk by chunk, as chunked prefill pushes
                    w.tx.push(rid, address, src[i:i + 4], dst[i:i + 4])
                notice = TransferNotice(rid, 42, False, 36, seed=7)
                w.tx.finish(rid, notice)
                up = until_terminal(w.rx, rid)
                assert (up.status, up.notice) == (S.DONE, notice), up
                assert until_terminal(w.tx, rid).status == S.DONE
                # every consumer rank of the group has its heads of the producer group's KV;
                # every other consumer rank's pool is as it was
                for c, lay in enumerate(w.dst_lay):
                    if c in c_ranks:
                        want = _heads(w.refs[gp], lay)
                        assert torch.equal(w.dst[c][dst], want[src]), (rid, c)
                        others = [i for i in range(NB) if i not in dst]
                        assert bool((w.dst[c][others] == -1).all()), (rid, c)
                    else:
                        assert bool((w.dst[c] == -1).all()), (rid, c)
                # bytes: only the ranks the plan names, of the two groups, moved any
                senders = {p_ranks[part.src_rank] for part in
                           [q for a in range(w.pa) for q in parts_from(a, w.pa, w.ca, heads)]}
                sent = [a - b for a, b in zip(w.payload(True), p_before, strict=True)]
                got = [a - b for a, b in zip(w.payload(False), c_before, strict=True)]
                assert [n > 0 for n in sent] == [r in senders for r in range(pt)], (rid, sent)
                assert [n > 0 for n in got] == [r in c_ranks for r in range(ct)], (rid, got)
                per_block = LAYERS * 2 * BS * DIM * 4
                assert sum(got) == sum(sent) == len(src) * per_block * sum(
                    w.dst_lay[r].head_count for r in c_ranks)
                # the idle ranks never held a record of it (they heard nothing of it)
                assert [n > 0 for n in w.records(True)] == \
                    [r in senders for r in range(pt)], rid
                w.tx.release(rid)
                w.rx.release(rid)
                assert w.records(True) == [0] * pt and w.records(False) == [0] * ct
    finally:
        w.close()


def test_a_group_the_worker_does_not_have_is_an_error_naming_the_field():
    w = DPWorkers(2, 2, 2, 2, 1)
    try:
        w.groups["far"] = (0, 2)
        with pytest.raises(ValueError, match="dp_rank"):
            w.rx.expect("far", [1, 2], source_tp=1)
        assert w.records(False) == [0, 0]
        w.groups["ok"] = (1, 1)  # the worker serves on
        w.rx.expect("ok", [1, 2], source_tp=1)
        _ready(w.rx, "ok")
        w.rx.cancel("ok", "done")
        assert until_terminal(w.rx, "ok").status == S.CANCELLED
        w.rx.release("ok")
    finally:
        w.close()
