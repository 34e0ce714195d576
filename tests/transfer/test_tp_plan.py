"""The TP split of a layout, the heads plan between two TP sizes, the cut geometry and the
handshake's TP checks: pure units, no transfer."""

from __future__ import annotations

import itertools
from collections import Counter

import pytest
import torch

from engine.kv_layout import KVLayout, head_range
from transfer import HandshakeError, handshake
from transfer.head_cut import HeadCut, cut_between
from transfer.pool import strided
from transfer.tp_plan import part_between, parts_from, parts_to, plan

HEADS = [1, 2, 3, 4, 6, 8, 16]
TPS = [1, 2, 3, 4, 6, 8, 16]
VALID = [(a, b, h) for a, b, h in itertools.product(TPS, TPS, HEADS)
         if (h % a == 0 or a % h == 0) and (h % b == 0 or b % h == 0)]


def test_the_matrix_covers_every_shape_of_split() -> None:
    kinds = {(a > h, b > h, a > b, a < b) for a, b, h in VALID}
    assert len(VALID) > 150
    # replicated on either side or both, and either side the wider one
    assert {(True, False, True, False), (False, True, False, True), (True, True, True, False),
            (True, True, False, True), (False, False, True, False)} <= kinds


@pytest.mark.parametrize(("a", "b", "h"), VALID)
def test_each_consumer_rank_receives_exactly_its_heads_once(a: int, b: int, h: int) -> None:
    parts = plan(a, b, h)
    for c in range(b):
        start, count = head_range(h, b, c)
        got: list[int] = []
        for part in parts_to(c, a, b, h):
            got += range(part.head, part.head + part.num_heads)
            # the sender really holds them, where the part says
            p_start, p_count = head_range(h, a, part.src_rank)
            assert p_start <= part.head and part.head + part.num_heads <= p_start + p_count
            assert part.src_first == part.head - p_start
            assert part.dst_first == part.head - start
        assert got == list(range(start, start + count)), (c, got)  # exact, ordered, no dups
        srcs = [p.src_rank for p in parts_to(c, a, b, h)]
        assert len(srcs) == len(set(srcs))  # one part per producer rank
    # what crosses the wire: every consumer rank's heads, once each
    assert sum(p.num_heads for p in parts) == sum(head_range(h, b, c)[1] for c in range(b))
    assert sorted(parts) == sorted(p for s in range(a) for p in parts_from(s, a, b, h))


@pytest.mark.parametrize(("a", "b", "h"), [v for v in VALID if v[0] > v[2]])
def test_replicated_heads_spread_over_their_replicas(a: int, b: int, h: int) -> None:
    reps = a // h  # producer ranks holding each head
    for head in range(h):
        takers = [p for p in plan(a, b, h) if p.head <= head < p.head + p.num_heads]
        used = Counter(p.src_rank for p in takers)
        assert len(used) == min(reps, len(takers)), (head, used)


def test_worked_examples() -> None:
    # TP2 producer -> TP1 consumer: the consumer pulls from both ranks
    assert [(p.src_rank, p.head, p.num_heads) for p in parts_to(0, 2, 1, 4)] == \
        [(0, 0, 2), (1, 2, 2)]
    # TP1 producer -> TP2 consumer: one producer rank feeds both
    assert [(p.dst_rank, p.src_first, p.num_heads) for p in parts_from(0, 1, 2, 4)] == \
        [(0, 0, 2), (1, 2, 2)]
    # 1 KV head, TP4 -> TP2: each consumer rank gets it from a different replica
    assert [(p.src_rank, p.dst_rank) for p in plan(4, 2, 1)] == [(0, 0), (1, 1)]
    assert part_between(2, 0, 4, 2, 1) is None


@pytest.mark.parametrize(("a", "b", "h", "field"), [(3, 1, 4, "producer tp_size"),
                                                    (1, 3, 4, "consumer tp_size"),
                                                    (0, 1, 4, "producer tp_size")])
def test_a_split_that_cannot_be_made_names_the_side(a: int, b: int, h: int, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        plan(a, b, h)


def test_layout_tp_split() -> None:
    full = KVLayout("m", "bfloat16", 16, 4, 8, 64, 10)
    r1 = KVLayout("m", "bfloat16", 16, 4, 8, 64, 10, tp_size=4, tp_rank=1)
    assert (full.head_start, full.head_count) == (0, 8)
    assert (r1.head_start, r1.head_count, r1.block_shape) == (2, 2, (4, 2, 16, 2, 64))
    assert r1.block_nbytes * 4 == full.block_nbytes
    assert r1.fingerprint() == full.fingerprint()  # the split is not the content
    rep = KVLayout("m", "bfloat16", 16, 4, 2, 64, 10, tp_size=8, tp_rank=5)
    assert (rep.head_start, rep.head_count) == (1, 1)
    with pytest.raises(ValueError, match="tp_rank"):
        KVLayout("m", "bfloat16", 16, 4, 8, 64, 10, tp_size=2, tp_rank=2)
    with pytest.raises(ValueError, match="tp_size"):
        KVLayout("m", "bfloat16", 16, 4, 8, 64, 10, tp_size=3)


def test_cut_rows_are_the_heads_slice() -> None:
    src = KVLayout("m", "float32", 4, 3, 4, 8, 6, tp_size=1)
    dst = KVLayout("m", "float32", 4, 3, 4, 8, 6, tp_size=2, tp_rank=1)
    cut = cut_between(src, dst)
    assert isinstance(cut, HeadCut) and not cut.whole
    pool = torch.randn(6, *src.block_shape)
    flat = pool.view(-1).view(torch.uint8)
    got = strided(flat, cut.src_rows(2, 3)).contiguous().view(torch.float32)
    want = pool[2:5, :, :, :, 2:4, :].contiguous().view(-1)
    assert torch.equal(got.view(-1), want)
    assert cut.nbytes(3) == want.numel() * 4
    out = torch.zeros(6, *dst.block_shape)
    strided(out.view(-1).view(torch.uint8), cut.dst_rows(1, 3)).copy_(
        strided(flat, cut.src_rows(2, 3)))
    assert torch.equal(out[1:4], pool[2:5, ..., 2:4, :])
    with pytest.raises(ValueError, match="outside"):
        strided(flat, cut.src_rows(5, 2))


def _hello(layout: KVLayout, **over: object) -> dict[str, object]:
    out = handshake.hello(layout, "ucx", b"")
    out["layout"] = {**out["layout"], **over}  # type: ignore[dict-item]
    return out


def test_handshake_accepts_other_tp_and_names_what_differs() -> None:
    me = KVLayout("m", "bfloat16", 16, 4, 4, 64, 10, tp_size=2, tp_rank=0)
    peer = KVLayout("m", "bfloat16", 16, 4, 4, 64, 20, tp_size=4, tp_rank=3)
    assert handshake.check(me, "ucx", handshake.hello(peer, "ucx", b""), "p") == peer
    with pytest.raises(HandshakeError, match="head_start/head_count"):
        handshake.check(me, "ucx", _hello(peer, head_start=0), "p")
    with pytest.raises(HandshakeError, match="tp_rank"):
        handshake.check(me, "ucx", _hello(peer, tp_rank=4), "p")
    with pytest.raises(HandshakeError, match="tp_size"):
        handshake.check(me, "ucx", _hello(peer, tp_size=3, tp_rank=0), "p")
    with pytest.raises(HandshakeError, match="tp_size: expected an int"):
        handshake.check(me, "ucx", _hello(peer, tp_size=4.0), "p")
    other = KVLayout("m", "bfloat16", 16, 4, 8, 64, 20, tp_size=2, tp_rank=1)
    with pytest.raises(HandshakeError, match="num_kv_heads: 4 != 8"):
        handshake.check(me, "ucx", handshake.hello(other, "ucx", b""), "p")
    # a peer that claims our fingerprint over another layout is caught too
    forged = handshake.hello(other, "ucx", b"")
    forged["fingerprint"] = me.fingerprint()
    with pytest.raises(HandshakeError, match="num_kv_heads"):
        handshake.check(me, "ucx", forged, "p")
