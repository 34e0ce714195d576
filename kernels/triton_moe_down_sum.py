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

NEXT_NORM (``down_sum(..., next_norm=(weight, eps, residual))``): the next decoder
layer's input_layernorm (residual add + RMSNorm, kernels/triton_norm.rms_norm) in the same
launch, the "last program done" pattern of kernels/triton_router_route.py. Each program
adds the residual to its BLOCK_N columns of the MoE row (rounded first, as out would hold
it) and stores the sum, the new residual, to out; then ``tl.debug_barrier()`` (every
thread's stores before the one-thread increment), then an acq_rel gpu-scope increment of
the token's counter (kernels/last_program.py): the program that reads programs - 1 has
acquired every other program's columns. It resets the counter, reads the whole new
residual row back from L2 (``.cg``: its SM's L1 is not coherent with other SMs' stores)
and stores the normed row, with rms_norm's own jit helpers, so the same bits. The MoE row
itself is never stored: the next layer reads only the normed row and the new residual,
and storing the new residual in its place is the exchange between the programs (the last
one need not read the residual again nor store the new one). The launch runs at
rms_norm's warps for the row (norm_warps, as kernels/triton_router_route.py's PRENORM):
the same register layout, so on a GPU the sum of squares adds in the same order as
_rms_norm_kernel's, and the normed row is rms_norm's of the new residual bit for bit. The
weight tiles' thread count changes with it (4 -> 8 warps at H = 2048, 16 at 4096 and
7168), and with it, where the tile is too small for the threads, the tile's register
layout (sm_90 TTGIR, tests/kernels/test_moe_sm90.py): bf16 weights in 256-wide K tiles
reduce each row over K as at 4 warps (8 elements a thread, 32 lanes a row) at 8 and 16
warps, FP8 per-channel ones at 8; FP8 at 16 warps (V3's H = 7168) and 128-wide K tiles
(block scales, I < 256) do not, so there the MoE row, hence the new residual, equals
down_sum's up to the order of each pair's sum over K (the kind of difference that
DOWN_SUM_MAX_TOKENS itself makes against _down_kernel; the interpreter's are equal). The
other choice, 4 warps, keeps the MoE row's bits and loses the norm's rstd bits instead.
A GPU A/B times what the warps cost the weight stream (engine.models.moe.NEXT_NORM_FUSED).

Reference: kernels/ref_moe.fused_moe_ref through kernels/triton_moe.fused_moe (this is
its steps 3 and 4 for the per-pair layout); with NEXT_NORM, rms_norm after it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.last_program import CounterPool
from kernels.moe_scales import k_tile, weight_groups
from kernels.pdl import follow
from kernels.triton_common import check, check_device, check_float, check_int, check_shape
from kernels.triton_norm import add_residual, norm_warps, rms_norm_row

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

# NEXT_NORM's per-token counters (kernels/last_program.py), this kernel's own
_POOL = CounterPool("down_sum")


@triton.jit
def _down_sum_kernel(
    a_ptr, w_ptr, out_ptr, ids_ptr, tw_ptr, sc_ptr,
    res_ptr, nw_ptr, normed_ptr, count_ptr,  # NEXT_NORM only: residual, weight, out, counters
    H, INTER, TOP_K, expert_start, num_local,
    s_a, s_we, s_wn, s_o,  # act row (a pair's); w2 expert, w2 row; out row
    s_se, s_sn,  # w2_scale expert, row (FP8 weights only)
    s_r, s_nm, eps,  # residual row, normed row, the norm's eps (NEXT_NORM only)
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
    SCALED: tl.constexpr, GROUP_K: tl.constexpr, ONE_GROUP: tl.constexpr, PDL: tl.constexpr,
    STAGES: tl.constexpr, NEXT_NORM: tl.constexpr, BLOCK_H: tl.constexpr,
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
    row = tok.to(tl.int64)
    y = total.to(out_ptr.dtype.element_ty)
    if NEXT_NORM:  # out holds the new residual (the module docstring)
        y = add_residual(y, tl.load(res_ptr + row * s_r + cols, mask=cols < H, other=0.0))
    tl.store(out_ptr + row * s_o + cols, y, mask=cols < H)
    if NEXT_NORM:
        tl.debug_barrier()  # every thread's columns stored before the one-thread release
        done = tl.atomic_add(count_ptr + row, 1, sem="acq_rel", scope="gpu")
        if done == tl.num_programs(1) - 1:  # the token's last program: every column acquired
            tl.store(count_ptr + row, 0)  # no program of this launch touches count[t] again
            hs = tl.arange(0, BLOCK_H)
            hm = hs < H
            # _rms_norm_kernel's row after its residual add (zero past H), from L2
            x = tl.load(out_ptr + row * s_o + hs, mask=hm, other=0.0, cache_modifier=".cg")
            normed = rms_norm_row(x, nw_ptr, hs, hm, H, eps)  # [BLOCK_H] float32
            tl.store(normed_ptr + row * s_nm + hs, normed.to(normed_ptr.dtype.element_ty),
                     mask=hm)


def counters(device: torch.device, tokens: int) -> torch.Tensor:
    """NEXT_NORM's counters on `device`, at least `tokens` (all zero between launches;
    never allocated during a CUDA-graph capture: kernels/last_program.CounterPool.get)."""
    return _POOL.get(device, tokens)


def down_sum(act: torch.Tensor, w2: torch.Tensor, topk_ids: torch.Tensor,
             topk_weights: torch.Tensor, out: torch.Tensor, expert_start: int = 0,
             w2_scale: torch.Tensor | None = None, pdl: bool = False,
             next_norm: tuple[torch.Tensor, float, torch.Tensor] | None = None
             ) -> tuple[torch.Tensor, torch.Tensor] | None:
    """out[t] = sum over j of topk_weights[t, j] * round(act[t * k + j] @ w2[e]^T), e the
    local expert of topk_ids[t, j] (pairs of another rank's experts skipped), in float32
    and rounded once to out's dtype.

    act: [T*k, I], a pair's activation row by pair index t * k + j; w2: [E_local, H, I]
    in act's dtype, or float8_e4m3fn with w2_scale [E_local, H, G] float32 (G = 1: per
    output channel; G > 1: per K / G columns, power-of-two groups >= 16); topk_ids: [T, k]
    int32/int64 global ids; topk_weights: [T, k] float32; out: [T, H], written.
    pdl: launch with programmatic dependent launch (kernels/pdl.py's pdl_for).
    next_norm: (weight [H], eps, residual [T, H] in out's dtype): rms_norm(that sum,
    weight, eps, residual) in the same launch (NEXT_NORM, the module docstring); out then
    receives the new residual, and the return is (normed [T, H], out). None otherwise."""
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
    groups = weight_groups("w2", w2, w2_scale, act.dtype, "act")
    res = nw = normed = count = out  # unread pointers without next_norm
    eps = 0.0
    if next_norm is not None:
        nw, eps, res = next_norm
        check_shape("next_norm weight", nw, (h,))
        check_float("next_norm weight", nw)
        check(nw.stride(0) == 1, "next_norm weight: must be contiguous")
        check_shape("next_norm residual", res, (t, h))
        check(res.dtype == out.dtype,
              f"next_norm residual: expected out's dtype {out.dtype}, got {res.dtype}")
        check(res.stride(1) == 1, "next_norm residual: rows must be contiguous")
        check_device(out, nw, res)
        normed = torch.empty(t, h, dtype=out.dtype, device=out.device)
    if t == 0 or h == 0:
        return None if next_norm is None else (normed, out)
    bk = k_tile(BLOCK_K, inter, groups)
    sc = w2_scale if w2_scale is not None else act  # an unread pointer without scales
    block_h, warps = 1, NUM_WARPS
    if next_norm is not None:
        count = counters(out.device, t)
        block_h = triton.next_power_of_2(h)
        # rms_norm's warps for the row, so the same sum of squares (the module docstring)
        warps = norm_warps(block_h)
    _down_sum_kernel[(t, triton.cdiv(h, BLOCK_N))](
        act, w2, out, topk_ids, topk_weights, sc, res, nw, normed, count,
        h, inter, k, expert_start, e_local,
        act.stride(0), w2.stride(0), w2.stride(1), out.stride(0),
        sc.stride(0) if w2_scale is not None else 0,
        sc.stride(1) if w2_scale is not None else 0,
        res.stride(0), normed.stride(0), float(eps),
        BLOCK_N=BLOCK_N, BLOCK_K=bk, EVEN_K=inter % bk == 0, SCALED=w2_scale is not None,
        GROUP_K=inter // groups if groups > 1 else 1, ONE_GROUP=groups == 1, PDL=pdl,
        STAGES=NUM_STAGES, NEXT_NORM=next_norm is not None, BLOCK_H=block_h,
        num_warps=warps, launch_pdl=pdl)
    return None if next_norm is None else (normed, out)
