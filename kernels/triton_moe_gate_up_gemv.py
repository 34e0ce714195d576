"""Triton MoE gate/up projection without tl.dot, for one-token (per-pair) calls.

kernels/triton_moe.py's per-pair path at one token runs `_gate_up_kernel` with tl.dot
tiles of BLOCK_M = 16 rows of which one is real, on a grid of (pairs, I / BLOCK_N): with
the H200 table's 128-column tile that is 88 programs at DeepSeek-V2-Lite (8 pairs,
I = 1408) and 48 at Qwen3-30B-A3B (I = 768), fewer than the GPU's 132 SMs, and the fused
MoE at batch 1 reads HBM at ~64% of its rate. Here a program owns BLOCK_N = 16 columns of
one pair (704 programs at V2-Lite, 384 at Qwen3-30B-A3B): it streams its expert's
[BLOCK_N, BLOCK_K] gate and up weight tiles against the token's [BLOCK_K] slice of x, into
two [BLOCK_N, BLOCK_K] float32 accumulators reduced over K once, after the loop.

Arithmetic (the same as `_gate_up_kernel`'s, up to the order of the sum over H): each of
gate and up summed in float32, scaled (FP8 weights), rounded to the model's dtype as HF's
unfused linear returns it, widened, then silu(gate) * up rounded once more. Pairs routed
to another rank's experts write nothing (their act row is never read).

Reference: kernels/ref_moe.fused_moe_ref through kernels/triton_moe.fused_moe (this is
its step 2 for the per-pair layout, GATE_UP_GEMV_MAX_TOKENS).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.moe_scales import k_tile, weight_groups
from kernels.pdl import follow
from kernels.triton_common import check, check_device, check_float, check_int

# Output columns (of I) per program: 16 gives 8 pairs x 88 = 704 programs at V2-Lite
# (I = 1408) and 8 x 48 = 384 at Qwen3-30B-A3B (I = 768), several per SM of an H100/H200
# (132) where the table's 128-column dot tile gave 88 and 48. A program can't take fewer
# columns usefully: each row is one 16-byte vector per thread along K, 16 rows a warp's
# natural [16, BLOCK_K] layout.
BLOCK_N = 16
# K columns (of H) per tile: 128 bf16 is 256 contiguous bytes a row, 4 KB per gate or up
# tile. Two [16, 128] float32 accumulators are 32 registers a thread at 4 warps, as many
# as down_sum's one [16, 256]: with several programs an SM here (down_sum has about one,
# hence its wider tile) the bytes in flight come from residency, not tile width.
BLOCK_K = 128
NUM_WARPS = 4
# NUM_STAGES - 1 gate + up tile pairs in flight per program through cp.async (24 KB at
# bf16). Given to the loop (tl.range), not the launch: a loop with no tl.dot is left
# unpipelined otherwise (sm_90 PTX: no cp.async). sm_90 ptxas: 25 KB of shared memory and
# 80 registers a thread a program at bf16 (96 with block scales), no spills
# (tests/kernels/test_moe_sm90.py), so registers allow 6 programs an SM: the whole V2-Lite
# grid (704 <= 6 x 132) resident at once. BLOCK_K and NUM_STAGES are what a GPU sweep
# should turn.
NUM_STAGES = 4


@triton.jit
def _gate_up_gemv_kernel(
    x_ptr, w_ptr, out_ptr, ids_ptr, sc_ptr,
    H, INTER, TOP_K, expert_start, num_local,
    s_x, s_we, s_wn, s_o,  # x row; w13 expert, w13 row; act row (all inner-contiguous)
    s_se, s_sn,  # w13_scale expert, row (FP8 weights only)
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
    SCALED: tl.constexpr, GROUP_K: tl.constexpr, ONE_GROUP: tl.constexpr, PDL: tl.constexpr,
    STAGES: tl.constexpr,
):
    if PDL:  # x is the kernel before's output (kernels/pdl.py)
        follow()
    pair = tl.program_id(0)
    e = tl.load(ids_ptr + pair).to(tl.int64) - expert_start
    if (e < 0) | (e >= num_local):  # another rank's expert: its act row is never read
        return
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN] of INTER
    ks = tl.arange(0, BLOCK_K)
    # Columns past INTER wrap around to rows of the tile's start, so the weight loads need
    # no row mask; the store drops them. A scalar base plus loop-invariant int32 offsets
    # (the launcher checks one expert fits): 64-bit pointer tiles spilled in the GEMMs.
    w_off = (cols % INTER)[:, None] * s_wn + ks[None, :]  # [BN, BK] int32
    w_gate = w_ptr + e * s_we
    w_up = w_gate + INTER * s_wn
    x_row = x_ptr + (pair // TOP_K).to(tl.int64) * s_x
    # FP8 weights: each row's scales (one, or one per GROUP_K columns), gate rows then up
    s_off = (cols % INTER) * s_sn  # [BN] int32
    s_gate = sc_ptr + e * s_se
    s_up = s_gate + INTER * s_sn
    acc_g = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    for k0 in tl.range(0, H, BLOCK_K, num_stages=STAGES):
        if EVEN_K:
            kw = k0
            a = tl.load(x_row + k0 + ks)
        else:
            # The last tile is moved back to end at H (the launcher keeps BLOCK_K <= H), so
            # the weight loads stay in bounds with no K mask and keep their 16-byte
            # vectors; x's columns already summed are zeroed instead.
            kw = tl.minimum(k0, H - BLOCK_K)
            a = tl.load(x_row + kw + ks, mask=kw + ks >= k0, other=0.0)
        a = a.to(tl.float32)[None, :]
        g = tl.load(w_gate + kw + w_off).to(tl.float32)  # an FP8 weight widens exactly
        u = tl.load(w_up + kw + w_off).to(tl.float32)
        if SCALED and not ONE_GROUP:
            # Block scales: the tile lies in one K group (the launcher's BLOCK_K), one
            # scale per row. Applied to the weight tile, not to a per-tile sum over K: that
            # would cost a cross-thread reduction per tile instead of a multiply per weight.
            grp = k0 // GROUP_K
            g = g * tl.load(s_gate + s_off + grp)[:, None]
            u = u * tl.load(s_up + s_off + grp)[:, None]
        acc_g += g * a
        acc_u += u * a
    gate = tl.sum(acc_g, axis=1)  # [BN] float32
    up = tl.sum(acc_u, axis=1)
    if SCALED and ONE_GROUP:  # per-channel scales: once, on the sums
        gate = gate * tl.load(s_gate + s_off)
        up = up * tl.load(s_up + s_off)
    # rounded to the storage dtype as HF's unfused linear outputs are, then the activation
    # (_gate_up_kernel's epilogue)
    g_r = gate.to(out_ptr.dtype.element_ty).to(tl.float32)
    u_r = up.to(out_ptr.dtype.element_ty).to(tl.float32)
    act = g_r / (1.0 + tl.exp(-g_r)) * u_r
    tl.store(out_ptr + pair.to(tl.int64) * s_o + cols, act.to(out_ptr.dtype.element_ty),
             mask=cols < INTER)


def gate_up_gemv(x: torch.Tensor, w13: torch.Tensor, act: torch.Tensor,
                 topk_ids: torch.Tensor, expert_start: int = 0,
                 w13_scale: torch.Tensor | None = None, pdl: bool = False) -> None:
    """act[t * k + j] = silu(round(x[t] @ gate[e]^T)) * round(x[t] @ up[e]^T), rounded to
    act's dtype, e the local expert of topk_ids[t, j] and gate / up the first / last I rows
    of w13[e]; rows of pairs routed to another rank's experts are left as they are.

    x: [T, H]; w13: [E_local, 2I, H] in x's dtype, or float8_e4m3fn with w13_scale
    [E_local, 2I, G] float32 (G = 1: per output channel; G > 1: per H / G columns,
    power-of-two groups >= 16); act: [T*k, I] in x's dtype, written; topk_ids: [T, k]
    int32/int64 global ids. pdl: launch with programmatic dependent launch
    (kernels/pdl.py's pdl_for)."""
    check(x.dim() == 2 and w13.dim() == 3, "x, w13: expected [T, H], [E, 2I, H]")
    check(topk_ids.dim() == 2, "topk_ids: expected [T, k]")
    t, h = x.shape
    e_local, two_i, hw = w13.shape
    inter = two_i // 2
    if two_i % 2 or hw != h:
        raise ValueError(f"w13: expected [E, 2I, {h}], got {tuple(w13.shape)}")
    if topk_ids.shape[0] != t:
        raise ValueError(f"topk_ids: expected {t} rows (x's tokens), got {topk_ids.shape[0]}")
    k = topk_ids.shape[1]
    if tuple(act.shape) != (t * k, inter):
        raise ValueError(f"act: expected {(t * k, inter)}, got {tuple(act.shape)}")
    check_float("x", x)
    check(act.dtype == x.dtype, f"act: expected x's dtype {x.dtype}, got {act.dtype}")
    check_int("topk_ids", topk_ids)
    check(topk_ids.is_contiguous(), "topk_ids: expected contiguous")  # pair t * k + j
    check(x.stride(1) == 1 and w13.stride(2) == 1 and act.stride(1) == 1,
          "x, w13, act: rows must be contiguous")
    check(w13.stride(0) < 2**31, "w13: an expert too large for the kernel's int32 offsets")
    check_device(x, w13, act, topk_ids)
    groups = weight_groups("w13", w13, w13_scale, x.dtype, "x")
    if t * k == 0 or inter == 0:
        return
    bk = k_tile(BLOCK_K, h, groups)
    sc = w13_scale if w13_scale is not None else x  # an unread pointer without scales
    _gate_up_gemv_kernel[(t * k, triton.cdiv(inter, BLOCK_N))](
        x, w13, act, topk_ids, sc, h, inter, k, expert_start, e_local,
        x.stride(0), w13.stride(0), w13.stride(1), act.stride(0),
        sc.stride(0) if w13_scale is not None else 0,
        sc.stride(1) if w13_scale is not None else 0,
        BLOCK_N=BLOCK_N, BLOCK_K=bk, EVEN_K=h % bk == 0, SCALED=w13_scale is not None,
        GROUP_K=h // groups if groups > 1 else 1, ONE_GROUP=groups == 1, PDL=pdl,
        STAGES=NUM_STAGES, num_warps=NUM_WARPS, launch_pdl=pdl)
