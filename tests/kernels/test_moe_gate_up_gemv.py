"""Dot-free gate/up at one token (kernels/triton_moe_gate_up_gemv.py), through fused_moe's
per-pair path with GATE_UP_GEMV_MAX_TOKENS on: the same result as _gate_up_kernel's (up to
the order of the sum over H), the same act rows, and _gate_up_kernel's launch replaced."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

# the one-token inputs (FP8 stacks, expert shards, shared experts) and launch counter of
# the down + sum switch's tests, whose comparison this one repeats for step 2
from tests.kernels.test_moe_down_sum import (
    F32_TOL,
    INTERP_BF16_SWITCH_TOL,
    _inputs,
    _launches,
    _rel,
)
from tests.kernels.test_moe_down_sum import _check as check_switch
from tests.kernels.test_moe_down_sum import _moe as switch_moe

SWITCH = "GATE_UP_GEMV_MAX_TOKENS"


def _moe(args: dict[str, Any], gemv: bool, monkeypatch: pytest.MonkeyPatch) -> torch.Tensor:
    return switch_moe(args, gemv, monkeypatch, SWITCH)


def _check(args: dict[str, Any], monkeypatch: pytest.MonkeyPatch,
           close: Callable[[torch.Tensor, torch.Tensor, torch.dtype], None]) -> None:
    """The switch on against the switch off and the float32 reference (gate and up are
    rounded to bf16 before the activation: a last-bit difference in a sum can flip one
    element's rounding, within the close fixture's bound)."""
    check_switch(args, monkeypatch, close, SWITCH)


# (h, inter, e, k, shared, e_local, start): H off the K tile (the moved-back last tile),
# I off the 16-column tile (wrapped columns), shared experts, and expert shards
SHAPES = [
    (32, 48, 8, 2, 0, 8, 0),  # whole tiles
    (40, 24, 6, 3, 2, 8, 0),  # H = 40: a 32-column tile, then one moved back by 8; I = 24
    (48, 40, 8, 3, 1, 5, 4),  # this rank: routed experts 4-7 and the shared one
    (24, 32, 8, 4, 0, 4, 0),  # experts 0-3 only: the other rank's pairs write nothing
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("h,inter,e,k,shared,e_local,start", SHAPES)
def test_gate_up_gemv_equals_dot_kernel(h, inter, e, k, shared, e_local, start, dtype, gen,
                                        device, monkeypatch, close):
    _check(_inputs(h, inter, e, k, shared, e_local, start, dtype, "none", gen, device),
           monkeypatch, close)


@pytest.mark.parametrize("h", [64, 80])  # whole 16-column K tiles; a moved-back last one
def test_gate_up_gemv_many_k_tiles(h, gen, device, monkeypatch, close):
    # 16-column K tiles: several per program, through the pipelined loop
    import kernels.triton_moe_gate_up_gemv as gu

    monkeypatch.setattr(gu, "BLOCK_K", 16)
    _check(_inputs(h, 24, 8, 3, 1, 9, 0, torch.float32, "none", gen, device), monkeypatch,
           close)


def test_gate_up_gemv_fp16(gen, device, monkeypatch, close):
    _check(_inputs(40, 24, 8, 2, 1, 9, 0, torch.float16, "none", gen, device), monkeypatch,
           close)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block", [None, (32, 32), (16, 16)])
def test_gate_up_gemv_fp8_experts(block, dtype, gen, device, monkeypatch, close):
    # per-channel scales (once on the sums) and block scales (per K tile: H = 64 in two or
    # four groups; the tile narrows to the group)
    _check(_inputs(64, 32, 8, 3, 1, 9, 0, dtype, block, gen, device), monkeypatch, close)


@pytest.mark.parametrize("block", [None, (32, 32)])
def test_gate_up_gemv_fp8_expert_shard(block, gen, device, monkeypatch, close):
    _check(_inputs(64, 64, 8, 3, 0, 4, 4, torch.float32, block, gen, device), monkeypatch,
           close)


def _dot_act(args: dict[str, Any]) -> torch.Tensor:
    """_gate_up_kernel's act rows in the per-pair layout, launched as fused_moe does."""
    import triton

    import kernels.triton_moe as m
    from kernels.triton_common import compute_dtype

    x, w13, ids = args["x"], args["w13"], args["topk_ids"].contiguous()
    scale = args.get("w13_scale")
    t, h = x.shape
    e_local, two_i, _ = w13.shape
    inter, k = two_i // 2, ids.shape[1]
    cfg = m.tile_config(t, x.device, w13.element_size())
    bm, bn, bk = cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["BLOCK_K"]
    g = scale.shape[2] if scale is not None else 1
    if g > 1:
        bk = min(bk, h // g)
    act = torch.full((t * k, inter), float("nan"), dtype=x.dtype, device=x.device)
    s13 = scale if scale is not None else x
    m._gate_up_kernel[(t * k, triton.cdiv(inter, bn))](
        x, w13, act, ids, ids, s13, ids, t * k, h, inter, k, args["expert_start"], e_local,
        x.stride(0), w13.stride(0), w13.stride(1), act.stride(0),
        s13.stride(0) if scale is not None else 0, s13.stride(1) if scale is not None else 0,
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, DOT_DTYPE=compute_dtype(x),
        IEEE=x.dtype == torch.float32, EVEN_K=h % bk == 0, SCALED=scale is not None,
        GROUP_K=h // g if g > 1 else 1, ONE_GROUP=g == 1, PDL=False, PER_PAIR=True,
        num_warps=cfg.get("num_warps", 4))
    return act


@pytest.mark.parametrize("dtype,block", [(torch.float32, "none"), (torch.bfloat16, "none"),
                                         (torch.float32, (16, 16))])
def test_gate_up_gemv_act_rows_equal_dot_kernels(dtype, block, gen, device):
    # the launcher itself: this rank's pairs' rows as _gate_up_kernel writes them; the
    # other rank's rows left untouched (NaN here) by both
    from kernels.triton_moe_gate_up_gemv import gate_up_gemv

    args = _inputs(48, 40, 8, 3, 1, 5, 4, dtype, block, gen, device)  # I off the tile
    ref = _dot_act(args)
    x, ids = args["x"], args["topk_ids"]
    act = torch.full_like(ref, float("nan"))
    gate_up_gemv(x, args["w13"], act, ids, args["expert_start"], args.get("w13_scale"))
    local = ids.flatten() - args["expert_start"]
    mine = (local >= 0) & (local < args["w13"].shape[0])
    assert 0 < int(mine.sum()) < mine.numel()  # pairs of both kinds
    assert torch.isnan(act[~mine]).all() and torch.isnan(ref[~mine]).all()
    tol = F32_TOL if dtype == torch.float32 else INTERP_BF16_SWITCH_TOL
    assert _rel(act[mine], ref[mine]) < tol, _rel(act[mine], ref[mine])


def test_gate_up_gemv_tokens_and_int32_ids(gen, device):
    # the launcher at 3 tokens (pair t * k + j reads token t), int32 ids, against its
    # contract: gate and up rounded to bf16, silu(gate) * up rounded once more
    from kernels.triton_moe_gate_up_gemv import gate_up_gemv

    t, k, h, inter, e = 3, 2, 48, 24, 4
    x = torch.randn(t, h, generator=gen).to(torch.bfloat16)
    w13 = (torch.randn(e, 2 * inter, h, generator=gen) * h**-0.5).to(torch.bfloat16)
    ids = torch.tensor([[0, 2], [3, 1], [5, 2]], dtype=torch.int32)  # 5: another rank's
    ref = torch.zeros(t * k, inter, dtype=torch.bfloat16)
    for i in range(t):
        for j in range(k):
            if ids[i, j] < e:
                gu = (x[i].float() @ w13[ids[i, j]].float().t()).bfloat16().float()
                g, u = gu[:inter], gu[inter:]
                ref[i * k + j] = (g * torch.sigmoid(g) * u).bfloat16()
    act = torch.zeros(t * k, inter, dtype=torch.bfloat16, device=device)
    gate_up_gemv(x.to(device), w13.to(device), act, ids.to(device))
    assert _rel(act.cpu(), ref) < 1e-2, _rel(act.cpu(), ref)
    assert torch.equal(act[4].cpu(), torch.zeros(inter, dtype=torch.bfloat16))  # id 5: unwritten


def test_gate_up_gemv_replaces_the_dot_kernels_launch(gen, device, monkeypatch):
    args = _inputs(32, 32, 8, 2, 1, 9, 0, torch.float32, "none", gen, device)
    with _launches() as off:
        _moe(args, False, monkeypatch)
    with _launches() as on:
        _moe(args, True, monkeypatch)
    assert off == {"_gate_up_kernel": 1, "_down_kernel": 1, "_sum_topk_kernel": 1}, off
    assert on == {"_gate_up_gemv_kernel": 1, "_down_kernel": 1, "_sum_topk_kernel": 1}, on


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_with_down_sum_the_experts_are_two_launches(dtype, gen, device, monkeypatch, close):
    # both one-token switches: gate/up as the GEMV, down and sum as one kernel
    import kernels.triton_moe as m

    args = _inputs(40, 24, 6, 3, 2, 8, 0, dtype, "none", gen, device)
    off = _moe(args, False, monkeypatch)
    monkeypatch.setattr(m, "DOWN_SUM_MAX_TOKENS", 1)
    with _launches() as counts:
        on = _moe(args, True, monkeypatch)
    assert counts == {"_gate_up_gemv_kernel": 1, "_down_sum_kernel": 1}, counts
    if dtype == torch.float32:
        assert _rel(on, off) < F32_TOL, _rel(on, off)
    else:
        close(on, off, dtype)


# past one token: tests/kernels/test_moe_down_sum.py's test_past_one_token_keeps_the_unfused_path


def test_gate_up_gemv_bad_arguments_are_refused(device):
    from kernels.triton_moe_gate_up_gemv import gate_up_gemv

    x = torch.zeros(2, 32, device=device)
    w13 = torch.zeros(3, 16, 32, device=device)
    ids = torch.zeros(2, 2, dtype=torch.int64, device=device)
    act = torch.empty(4, 8, device=device)
    with pytest.raises(ValueError, match=r"act: expected \(4, 8\)"):
        gate_up_gemv(x, w13, act[:3], ids)
    with pytest.raises(ValueError, match=r"w13: expected \[E, 2I, 32\]"):
        gate_up_gemv(x, w13[:, :, :16], act, ids)
    with pytest.raises(ValueError, match="topk_ids: expected 2 rows"):
        gate_up_gemv(x, w13, act, ids[:1])
    with pytest.raises(ValueError, match="topk_ids: expected int32/int64"):
        gate_up_gemv(x, w13, act, ids.float())
    with pytest.raises(ValueError, match="act: expected x's dtype"):
        gate_up_gemv(x, w13, act.double(), ids)
    with pytest.raises(ValueError, match="w13: expected x's dtype"):
        gate_up_gemv(x, w13.bfloat16(), act, ids)
    with pytest.raises(ValueError, match="w13: w13_scale given, expected float8_e4m3fn"):
        gate_up_gemv(x, w13, act, ids, w13_scale=torch.ones(3, 16, 1, device=device))
    q13 = w13.to(torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="w13_scale: 3 scale groups"):
        gate_up_gemv(x, q13, act, ids, w13_scale=torch.ones(3, 16, 3, device=device))
    with pytest.raises(ValueError, match=r"w13_scale: expected \[3, 16, G\]"):
        gate_up_gemv(x, q13, act, ids, w13_scale=torch.ones(3, 8, 1, device=device))
