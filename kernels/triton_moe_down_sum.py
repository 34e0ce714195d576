"""Triton MoE down projection and top-k sum in one launch, for decode-sized calls.

kernels/triton_moe.py's per-pair path at one token runs gate/up, down, then the weighted
sum of each token's k expert rows: three launches, and at batch 1 in a CUDA graph each
launch costs a few microseconds however little it does (a DeepSeek-V2-Lite decode step is
~350 kernels). Here down and sum are one kernel: a program owns BLOCK_N output columns of
one token and walks that token's k (token, expert) pairs in slot order, so each pair's
down-projection row never leaves registers and the [T*k, H] row buffer is not needed.

Arithmetic (the same as `_down_kernel` then `_sum_topk_kernel`, up to the order of the
sum over I): each pair's row is summed over I in float32, scaled (FP8 weights), rounded to
out's dtype as HF's expert returns it, widened, multiplied by its float32 router weight
and added into a float32 total in slot order; pairs routed to another rank's experts add
nothing. The total is rounded once.

No tl.dot: one token is one real row, and a dot pads M to 16 rows of tensor-core work.
A [BLOCK_N, BLOCK_K] weight tile is widened to float32 and multiplied by the pair's
[BLOCK_K] activation slice into a 2-D float32 accumulator, reduced over K once per pair.
One loop runs over (pair, K tile), not a loop per pair: Triton's pipeliner pipelines the
innermost loop only, and a pair's I (1408 at V2-Lite, 768 at Qwen3-30B-A3B) is a handful
of tiles, so a loop per pair would drain the weight stream's loads in flight at every pair.

Reference: kernels/ref_moe.fused_moe_ref through kernels/triton_moe.fused_moe (this is
its steps 3 and 4 for the per-pair layout).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.moe_scales import scale_groups
from kernels.pdl import follow
from kernels.triton_common import check, check_device, check_float, check_int

FP8 = torch.float8_e4m3fn
# Output columns per program: H = 2048 (V2-Lite, Qwen3-30B-A3B) gives 128 programs at one
# token, about one per SM of an H100/H200 (132). K can't be split over more programs (a
# pair's row is rounded whole before it is weighted), so the grid is H / BLOCK_N.
BLOCK_N = 16
# K columns per tile: a [16, 256] bf16 tile is 8 KB a load, 512 contiguous bytes a row (a
# warp's 16-byte vectors along one row); its float32 accumulator is 32 registers a thread
# at 4 warps. The weight bytes in flight over the grid are H * BLOCK_K * (NUM_STAGES - 1)
# weights whatever BLOCK_N: BLOCK_K and NUM_STAGES are what a GPU sweep should turn.
BLOCK_K = 256
NUM_WARPS = 4
# NUM_STAGES - 1 tiles in flight per program through cp.async: at ~one program per SM
# nothing else covers HBM latency. Given to the loop (tl.range), not the launch: a loop
# with no tl.dot is left unpipelined otherwise (sm_90 PTX: no cp.async). 26 KB of shared
# memory a program at bf16; ptxas reports no spills (tests/kernels/test_moe_sm90.py).
NUM_STAGES = 4


@triton.jit
def _down_sum_kernel(
    a_ptr, w_ptr, out_ptr, ids_ptr, tw_ptr, sc_ptr,
    H, INTER, TOP_K, expert_start, num_local,
    s_a, s_we, s_wn, s_o,  # act row (a pair's); w2 expert, w2 row; out row
    s_se, s_sn,  # w2_scale expert, row (FP8 weights only)
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
    SCALED: tl.constexpr, GROUP_K: tl.constexpr, ONE_GROUP: tl.constexpr, PDL: tl.constexpr,
    STAGES: tl.constexpr,
):
    if PDL:  # the activation is the kernel before's output (kernels/pdl.py)
        follow()
    tok = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN] of H
    ks = tl.arange(0, BLOCK_K)
    # Columns past H wrap around to rows of the tile's start, so the weight loads need no
    # column mask; the store drops them. A scalar base plus loop-invariant int32 offsets
    # (the launcher checks one expert fits): 64-bit pointer tiles spilled in the GEMMs.
    w_off = (cols % H)[:, None] * s_wn + ks[None, :]  # [BN, BK] int32
    s_off = (cols % H) * s_sn  # [BN] int32
    k_tiles = tl.cdiv(INTER, BLOCK_K)
    acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)  # the current pair's products
    total = tl.zeros([BLOCK_N], dtype=tl.float32)  # the weighted sum over pairs so far
    for i in tl.range(0, TOP_K * k_tiles, num_stages=STAGES):
        j = i // k_tiles  # the slot: pairs in slot order, as _sum_topk_kernel adds them
        k0 = (i - j * k_tiles) * BLOCK_K
        pair = (tok * TOP_K + j).to(tl.int64)
        e = tl.load(ids_ptr + pair).to(tl.int64) - expert_start
        ok = (e >= 0) & (e < num_local)  # else another rank's expert: its loads are off
        e = tl.where(ok, e, 0)
        # (an activation row of another rank's pair was never written: not read either)
        if EVEN_K:
            kw = k0
            a = tl.load(a_ptr + pair * s_a + k0 + ks, mask=ok, other=0.0)
        else:
            # The last tile is moved back to end at INTER (the launcher keeps BLOCK_K <=
            # INTER), so the weight load stays in bounds with no K mask, and its 16-byte
            # vectors survive; the activation's columns already summed are zeroed instead.
            kw = tl.minimum(k0, INTER - BLOCK_K)
            a = tl.load(a_ptr + pair * s_a + kw + ks, mask=ok & (kw + ks >= k0), other=0.0)
        w = tl.load(w_ptr + e * s_we + kw + w_off, mask=ok, other=0.0).to(tl.float32)
        if SCALED and not ONE_GROUP:
            # Block scales: the tile lies in one K group (the launcher's BLOCK_K), one
            # scale per row. Applied to the weight tile, not to a per-tile sum over K: that
            # would cost a cross-thread reduction per tile instead of a multiply per weight.
            w = w * tl.load(sc_ptr + e * s_se + s_off + k0 // GROUP_K, mask=ok,
                            other=0.0)[:, None]
        acc += w * a.to(tl.float32)[None, :]
        if k0 + BLOCK_K >= INTER:  # the pair's last tile: its row is whole
            if ok:
                y = tl.sum(acc, axis=1)  # [BN] float32
                if SCALED and ONE_GROUP:  # per-channel scales: once, on the sum
                    y = y * tl.load(sc_ptr + e * s_se + s_off)
                wt = tl.load(tw_ptr + pair)  # float32
                # rounded as _down_kernel stores the expert's row, then weighted in
                # float32 as _sum_topk_kernel reads it back
                total += y.to(out_ptr.dtype.element_ty).to(tl.float32) * wt
            acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    tl.store(out_ptr + tok.to(tl.int64) * s_o + cols, total.to(out_ptr.dtype.element_ty),
             mask=cols < H)


def down_sum(act: torch.Tensor, w2: torch.Tensor, topk_ids: torch.Tensor,
             topk_weights: torch.Tensor, out: torch.Tensor, expert_start: int = 0,
             w2_scale: torch.Tensor | None = None, pdl: bool = False) -> None:
    """out[t] = sum over j of topk_weights[t, j] * round(act[t * k + j] @ w2[e]^T), e the
    local expert of topk_ids[t, j] (pairs of another rank's experts skipped), in float32
    and rounded once to out's dtype.

    act: [T*k, I], a pair's activation row by pair index t * k + j; w2: [E_local, H, I]
    in act's dtype, or float8_e4m3fn with w2_scale [E_local, H, G] float32 (G = 1: per
    output channel; G > 1: per K / G columns, power-of-two groups >= 16); topk_ids: [T, k]
    int32/int64 global ids; topk_weights: [T, k] float32; out: [T, H], written.
    pdl: launch with programmatic dependent launch (kernels/pdl.py's pdl_for)."""
    check(act.dim() == 2 and w2.dim() == 3, "act, w2: expected [T*k, I], [E, H, I]")
    check(topk_ids.dim() == 2, "topk_ids: expected [T, k]")
    t, k = topk_ids.shape
    e_local, h, inter = w2.shape
    if tuple(act.shape) != (t * k, inter):
        raise ValueError(f"act: expected {(t * k, inter)}, got {tuple(act.shape)}")
    if tuple(out.shape) != (t, h):
        raise ValueError(f"out: expected {(t, h)}, got {tuple(out.shape)}")
    check(tuple(topk_weights.shape) == (t, k), "topk_weights: expected the shape of topk_ids")
    check(topk_weights.dtype == torch.float32, "topk_weights: expected float32")
    check_int("topk_ids", topk_ids)
    check_float("act", act)
    check(out.dtype == act.dtype, f"out: expected act's dtype {act.dtype}, got {out.dtype}")
    # the kernel indexes pairs as t * k + j
    check(topk_ids.is_contiguous() and topk_weights.is_contiguous(),
          "topk_ids, topk_weights: expected contiguous")
    check(act.stride(1) == 1 and w2.stride(2) == 1 and out.stride(1) == 1,
          "act, w2, out: rows must be contiguous")
    check(w2.stride(0) < 2**31, "w2: an expert too large for the kernel's int32 offsets")
    check_device(act, w2, topk_ids, topk_weights, out)
    groups = 1
    if w2_scale is not None:
        check(w2.dtype == FP8, f"w2: w2_scale given, expected float8_e4m3fn, got {w2.dtype}")
        groups = scale_groups("w2_scale", w2_scale, w2)
    else:
        check(w2.dtype == act.dtype, f"w2: expected act's dtype {act.dtype}, got {w2.dtype}")
    if t == 0 or h == 0:
        return
    # A power of two no wider than I: the last tile moves back inside the row (the
    # kernel's EVEN_K comment); block scales: inside one group, so I is whole tiles.
    bk = min(BLOCK_K, 1 << (inter.bit_length() - 1)) if inter else BLOCK_K
    if groups > 1:
        bk = min(bk, inter // groups)
    sc = w2_scale if w2_scale is not None else act  # an unread pointer without scales
    _down_sum_kernel[(t, triton.cdiv(h, BLOCK_N))](
        act, w2, out, topk_ids, topk_weights, sc, h, inter, k, expert_start, e_local,
        act.stride(0), w2.stride(0), w2.stride(1), out.stride(0),
        sc.stride(0) if w2_scale is not None else 0,
        sc.stride(1) if w2_scale is not None else 0,
        BLOCK_N=BLOCK_N, BLOCK_K=bk, EVEN_K=inter % bk == 0, SCALED=w2_scale is not None,
        GROUP_K=inter // groups if groups > 1 else 1, ONE_GROUP=groups == 1, PDL=pdl,
        STAGES=NUM_STAGES, num_warps=NUM_WARPS, launch_pdl=pdl)
