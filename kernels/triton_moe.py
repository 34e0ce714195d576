"""Triton fused mixture-of-experts MLP (kernels/ref_moe.py's contract).

Four steps, none of which reads a device value on the host, so a decode step that runs
them can be captured in a CUDA graph (every size below comes from shapes alone):

1. align (kernels/triton_moe_align.py: one Triton program for a few pairs, a counting
   sort in three grid launches past ALIGN_ONE_PROGRAM_MAX_PAIRS): the T*k (token, slot)
   pairs are sorted by expert and each expert's run is padded to a multiple of BLOCK_M, so
   a BLOCK_M-row tile holds pairs of one expert only. Its output is `sorted_ids` (pair
   index per padded row; N = T*k marks padding) and `block_expert` (the local expert of
   each tile; -1 past the last tile). The tile count is bounded from shapes: an expert
   with c pairs needs ceil(c / BM) tiles, at most min(N, E_local) experts are non-empty,
   so N + min(N, E_local) * (BM - 1) rows. At one token the step is skipped
   (PER_PAIR_MAX_TOKENS): tile i is pair i, its expert read from topk_ids.
2. gate/up (`_gate_up_kernel`): a grouped GEMM, tile (m, n) computes rows m of one
   expert against columns n of that expert's gate and of its up projection, and stores
   silu(gate) * up: the [T*k, 2I] product never reaches memory. At one token it can be a
   dot-free kernel instead (GATE_UP_GEMV_MAX_TOKENS, kernels/triton_moe_gate_up_gemv.py:
   narrow column tiles of one pair each, more programs than a 16-row dot tile with one
   real row gives, the same arithmetic).
3. down (`_down_kernel`): the same grouped GEMM over w2; its epilogue rounds each pair's
   row to the model's dtype (as HF's expert MLP returns it) and stores it so, one row per
   pair.
4. sum (`_sum_topk_kernel`): each token's k rows times their router weights, added in
   float32 in slot order (the result is deterministic, unlike atomics); pairs routed to
   another rank's experts skipped. The weight is applied here, not in the down epilogue:
   HF multiplies the *rounded* expert output by the float32 weight, so a weighted row is
   float32 and would cost twice the bytes of the rounded one between the two kernels (a
   4,096-token V2-Lite prefill writes and reads 32,768 rows of 2,048 per layer), for the
   same arithmetic.
   Steps 3 and 4 can run as one launch at one token (DOWN_SUM_MAX_TOKENS,
   kernels/triton_moe_down_sum.py: each program walks the token's pairs in slot order, a
   pair's rounded row weighted and added in registers, the same arithmetic again).

FP8 experts (float8_e4m3fn w13/w2 with float32 per-row scales, per output channel or per
row and K group of a block-scaled checkpoint): both GEMMs widen the weight tile to the
activation dtype after its load and multiply the accumulator's columns by the scales (per
channel once after the K loop; per group each K tile), so activations stay in the model's
dtype and the weight stream, decode's cost, is one byte per weight.

Prefill-sized calls of bf16 experts on sm_90/sm_100 take the grouped-GEMM form of steps 1-3
(kernels/moe_grouped_gemm.py, from its MIN_TOKENS tokens: torch's CUTLASS grouped GEMM on
the expert-sorted rows, the sum reading them through a row map). The tensor-memory form
(kernels/triton_moe_tma.py, off by default) is the same rows with these kernels' products,
their operand tiles copied whole by the copy engine where these kernels gather them.

Decode reads each touched expert's weights once: a tile's weights are one expert's, and at
few tokens per expert there is one row tile per expert. Tile sizes come from
kernels/moe_configs.json, keyed by device name and token-count bucket.
"""

from __future__ import annotations

import functools
import json
import os
from typing import Any

import torch
import triton
import triton.language as tl

from kernels.moe_grouped_gemm import applies as grouped_applies
from kernels.moe_grouped_gemm import expert_rows_grouped
from kernels.moe_scales import scale_groups
from kernels.pdl import follow, pdl_for
from kernels.triton_common import check, check_device, check_float, check_int, compute_dtype
from kernels.triton_moe_align import moe_align_multi, moe_align_triton, one_program
from kernels.triton_moe_down_sum import down_sum
from kernels.triton_moe_gate_up_gemv import gate_up_gemv
from kernels.triton_moe_tma import applies as tma_applies
from kernels.triton_moe_tma import expert_rows

FP8 = torch.float8_e4m3fn
# Most BLOCK_M x BLOCK_N outputs of a gate/up tile with block-scaled FP8 weights.
BLOCK_SCALED_GATE_UP_TILE = 64 * 64
# Up to this many tokens the align step is skipped: row tile i holds (token, expert) pair i
# alone, its expert read from the routing's ids by the GEMMs themselves. One token's top-k
# experts (and its shared experts) are distinct, so every expert is still read once, with
# the one real row per tile that align's layout gives at one token anyway; what goes is the
# align launch, a single-program kernel of ~5.6 µs a layer on an H200 (a decode step of
# DeepSeek-V2-Lite at batch 1: bench/RESULTS.md). Past one token a shared or popular expert
# would be read once per pair routed to it.
PER_PAIR_MAX_TOKENS = 1
# Up to this many tokens (in the per-pair layout) down and sum are one kernel,
# kernels/triton_moe_down_sum.py: at batch 1 in a CUDA graph a launch costs a few µs
# whatever it does, and the sum kernel is one of ~350 in a V2-Lite decode step. 0 (off):
# on an H100 (session 36, bench/RESULTS.md) the step at batch 1 was 4.3% faster at
# Qwen3-30B-A3B's shape and 2.4% slower at V2-Lite's, whose pairs stream twice the tiles
# (bench/moe_bench.py --shape v2lite --batches 1 --variants
# "kernels.triton_moe.DOWN_SUM_MAX_TOKENS=1", its --quantization fp8 runs for FP8 experts).
# 1: the fused kernel at one token.
DOWN_SUM_MAX_TOKENS = 0
# Up to this many tokens (in the per-pair layout, no config given) gate/up is the dot-free
# kernel of kernels/triton_moe_gate_up_gemv.py: 16-column programs, 704 at V2-Lite where
# the table's 128-column dot tiles give 88 programs for 132 SMs. 0 (off): on an H100
# (session 36) 1.3% faster at V2-Lite's shape, 4.3% slower at Qwen3-30B-A3B's, and slower
# with DOWN_SUM_MAX_TOKENS than either alone at V2-Lite's (bench/moe_bench.py --shape
# v2lite --batches 1 --variants "kernels.triton_moe.GATE_UP_GEMV_MAX_TOKENS=1", its
# --quantization fp8 runs for FP8 experts). 1: the dot-free kernel at one token.
GATE_UP_GEMV_MAX_TOKENS = 0
# The gate/up tile's width in the per-pair layout (None: the table's; the down kernel's too
# where the table gives no BLOCK_N_DOWN). At one token the
# table's H200 tile (128 columns) gives V2-Lite's eight experts 8 x 11 = 88 programs, fewer
# than the GPU's 132 SMs, each streaming 1 MB; 64 or 32 columns give 176 or 352. Off. No
# A/B of 64 has measured anything yet: sessions 36 and 40 ran it on H100s, which read the
# table's "default" entry, whose tile is already 64 columns (so both sides ran the same
# grid; bench/moe_table.py runs one card's tiles on another). 32 was slower there (1.43
# against 1.19 ms, session 40). An H200's own A/B: bench/h200_open_points.sh's `tiles`.
PER_PAIR_BLOCK_N: int | None = None
CONFIG_FILE = os.path.join(os.path.dirname(__file__), "moe_configs.json")


@functools.cache
def _config_table() -> dict[str, dict[str, dict[str, int]]]:
    with open(CONFIG_FILE) as f:
        table: dict[str, dict[str, dict[str, int]]] = json.load(f)["configs"]
    return table


def tile_config(num_tokens: int, device: torch.device, elem_size: int = 2
                ) -> dict[str, int]:
    """The tile config for a call with `num_tokens` rows: the device's table (by its CUDA
    name; "cpu" for the interpreter), else "default"; within it the smallest bucket at or
    above num_tokens, else the largest. A device's entries are tuned for 16-bit weights:
    wider ones (float32) take the defaults, whose tiles fit an H200's shared memory at
    float32 (the tuned BLOCK_N 128 x BLOCK_K 128 asks 278,528 of its 232,448 bytes).
    elem_size 1 (FP8 experts) looks for "<device name> fp8" first."""
    table = _config_table()
    name = _device_name(device)
    tuned_for_16_bit = name != "cpu"  # the interpreter's entry serves every dtype
    # FP8 experts: the device's "<name> fp8" entry where one was tuned, else its 16-bit one
    buckets = table.get(f"{name} fp8") if elem_size == 1 else None
    buckets = buckets or (table.get(name) if elem_size <= 2 or not tuned_for_16_bit
                          else None) or table["default"]
    sizes = sorted(int(b) for b in buckets)
    pick = next((b for b in sizes if b >= num_tokens), sizes[-1])
    return buckets[str(pick)]


@functools.cache
def _device_name(device: torch.device) -> str:
    """Cached: the name is asked on every launch, on the decode step's host path."""
    return torch.cuda.get_device_name(device) if device.type == "cuda" else device.type


@triton.jit
def _tile_rows(pid_m, sorted_ptr, bexp_ptr, ids_ptr, N, expert_start, num_local,
               BLOCK_M: tl.constexpr, PER_PAIR: tl.constexpr):
    """Row tile pid_m's local expert (< 0: nothing to do) and its [BLOCK_M] pair per row
    (N: padding): from the align step's layout, or PER_PAIR, tile i is pair i alone, its
    expert read from the routing's ids (no align step; see PER_PAIR_MAX_TOKENS)."""
    if PER_PAIR:
        e = tl.load(ids_ptr + pid_m).to(tl.int64) - expert_start
        e = tl.where((e >= 0) & (e < num_local), e, -1)  # another rank's expert: no tile
        pair = tl.where(tl.arange(0, BLOCK_M) == 0, pid_m, N)
    else:
        e = tl.load(bexp_ptr + pid_m).to(tl.int64)
        pair = tl.load(sorted_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    return e, pair


@triton.jit
def _gate_up_kernel(
    x_ptr, w_ptr, out_ptr, sorted_ptr, bexp_ptr, sc_ptr, ids_ptr,
    N, H, INTER, TOP_K, expert_start, num_local,
    s_x, s_we, s_wn, s_o,  # x row; w13 expert, w13 row; act row (all inner-contiguous)
    s_se, s_sn,  # w13_scale expert, row (FP8 weights only)
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    DOT_DTYPE: tl.constexpr, IEEE: tl.constexpr, EVEN_K: tl.constexpr,
    SCALED: tl.constexpr, GROUP_K: tl.constexpr, ONE_GROUP: tl.constexpr, PDL: tl.constexpr,
    PER_PAIR: tl.constexpr,
):
    if PDL:  # the align step's layout is the kernel before's output (kernels/pdl.py)
        follow()
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    e, pair = _tile_rows(pid_m, sorted_ptr, bexp_ptr, ids_ptr, N, expert_start, num_local,
                         BLOCK_M, PER_PAIR)
    if e < 0:  # a tile past the experts' padded runs (or another rank's): nothing to do
        return
    row_ok = pair < N
    # Padding rows read token 0 and columns past INTER wrap around, so the loads need no
    # row or column masks; the store drops them. Addresses are a scalar base plus
    # loop-invariant int32 offsets (the launcher checks they fit): loop-carried pointer
    # tiles held every element's 64-bit address and spilled (ptxas, sm_90).
    tok = tl.where(row_ok, pair // TOP_K, 0)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN] of INTER
    ks = tl.arange(0, BLOCK_K)
    a_off = tok[:, None] * s_x + ks[None, :]  # [BM, BK] int32
    w_off = (cols % INTER)[None, :] * s_wn + ks[:, None]  # [BK, BN] int32
    w_gate = w_ptr + e * s_we
    w_up = w_gate + INTER * s_wn
    # FP8 weights: each row's scales (one, or one per GROUP_K columns), gate rows then up
    s_off = (cols % INTER) * s_sn  # [BN] int32
    s_gate = sc_ptr + e * s_se
    s_up = s_gate + INTER * s_sn
    acc_g = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, H, BLOCK_K):
        if EVEN_K:
            a = tl.load(x_ptr + k0 + a_off)
            g = tl.load(w_gate + k0 + w_off)
            u = tl.load(w_up + k0 + w_off)
        else:
            k_ok = ks < H - k0
            a = tl.load(x_ptr + k0 + a_off, mask=k_ok[None, :], other=0.0)
            g = tl.load(w_gate + k0 + w_off, mask=k_ok[:, None], other=0.0)
            u = tl.load(w_up + k0 + w_off, mask=k_ok[:, None], other=0.0)
        a = a.to(DOT_DTYPE)
        g = g.to(DOT_DTYPE)  # an FP8 weight widens exactly to 16 or 32 bits
        u = u.to(DOT_DTYPE)
        if SCALED and not ONE_GROUP:  # block scales: this K range's, per column
            grp = k0 // GROUP_K
            sg = tl.load(s_gate + s_off + grp)
            su = tl.load(s_up + s_off + grp)
            if IEEE:
                acc_g += tl.dot(a, g, input_precision="ieee") * sg[None, :]
                acc_u += tl.dot(a, u, input_precision="ieee") * su[None, :]
            else:
                acc_g += tl.dot(a, g) * sg[None, :]
                acc_u += tl.dot(a, u) * su[None, :]
        elif IEEE:  # float32 models: no TF32 (the attention kernels do the same)
            acc_g = tl.dot(a, g, acc_g, input_precision="ieee")
            acc_u = tl.dot(a, u, acc_u, input_precision="ieee")
        else:
            acc_g = tl.dot(a, g, acc_g)
            acc_u = tl.dot(a, u, acc_u)
    if SCALED and ONE_GROUP:  # per-channel scales: once, on the accumulator's columns
        acc_g = acc_g * tl.load(s_gate + s_off)[None, :]
        acc_u = acc_u * tl.load(s_up + s_off)[None, :]
    # rounded to the storage dtype as HF's unfused linear outputs are, then the activation
    g_r = acc_g.to(out_ptr.dtype.element_ty).to(tl.float32)
    u_r = acc_u.to(out_ptr.dtype.element_ty).to(tl.float32)
    act = g_r / (1.0 + tl.exp(-g_r)) * u_r
    tl.store(out_ptr + pair[:, None].to(tl.int64) * s_o + cols[None, :],
             act.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & (cols < INTER)[None, :])


@triton.jit
def _down_kernel(
    a_ptr, w_ptr, out_ptr, sorted_ptr, bexp_ptr, sc_ptr, ids_ptr,
    N, H, INTER, expert_start, num_local,
    s_a, s_we, s_wn, s_o,  # act row; w2 expert, w2 row; out row
    s_se, s_sn,  # w2_scale expert, row (FP8 weights only)
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    DOT_DTYPE: tl.constexpr, IEEE: tl.constexpr, EVEN_K: tl.constexpr,
    SCALED: tl.constexpr, GROUP_K: tl.constexpr, ONE_GROUP: tl.constexpr, PDL: tl.constexpr,
    PER_PAIR: tl.constexpr,
):
    if PDL:  # the activation is the kernel before's output (kernels/pdl.py)
        follow()
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    e, pair = _tile_rows(pid_m, sorted_ptr, bexp_ptr, ids_ptr, N, expert_start, num_local,
                         BLOCK_M, PER_PAIR)
    if e < 0:
        return
    row_ok = pair < N
    safe = tl.where(row_ok, pair, 0)  # padding rows read pair 0 (as _gate_up_kernel)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN] of H
    ks = tl.arange(0, BLOCK_K)
    a_off = safe[:, None] * s_a + ks[None, :]  # [BM, BK] int32
    w_off = (cols % H)[None, :] * s_wn + ks[:, None]  # [BK, BN] int32
    w_base = w_ptr + e * s_we
    s_row = sc_ptr + e * s_se  # FP8 weights' row scales: a scalar base, int32 offsets
    s_off = (cols % H) * s_sn  # [BN]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, INTER, BLOCK_K):
        if EVEN_K:
            a = tl.load(a_ptr + k0 + a_off)
            w = tl.load(w_base + k0 + w_off)
        else:
            k_ok = ks < INTER - k0
            a = tl.load(a_ptr + k0 + a_off, mask=k_ok[None, :], other=0.0)
            w = tl.load(w_base + k0 + w_off, mask=k_ok[:, None], other=0.0)
        a = a.to(DOT_DTYPE)
        w = w.to(DOT_DTYPE)
        if SCALED and not ONE_GROUP:
            sw = tl.load(s_row + s_off + k0 // GROUP_K)
            if IEEE:
                acc += tl.dot(a, w, input_precision="ieee") * sw[None, :]
            else:
                acc += tl.dot(a, w) * sw[None, :]
        elif IEEE:
            acc = tl.dot(a, w, acc, input_precision="ieee")
        else:
            acc = tl.dot(a, w, acc)
    if SCALED and ONE_GROUP:  # offsets made here, not kept through the K loop
        acc = acc * tl.load(sc_ptr + e * s_se + (cols % H) * s_sn)[None, :]
    pair64 = safe.to(tl.int64)
    # the expert's output rounded as HF's returns it; _sum_topk_kernel weights it
    tl.store(out_ptr + pair64[:, None] * s_o + cols[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=row_ok[:, None] & (cols < H)[None, :])


@triton.jit
def _sum_topk_kernel(y_ptr, ids_ptr, tw_ptr, out_ptr, map_ptr, H, TOP_K, expert_start,
                     num_local, s_y, s_o, BLOCK_H: tl.constexpr, HAS_MAP: tl.constexpr,
                     PDL: tl.constexpr):
    if PDL:  # the experts' rows are the kernel before's output (kernels/pdl.py)
        follow()
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    mask = cols < H
    acc = tl.zeros([BLOCK_H], dtype=tl.float32)
    for j in range(0, TOP_K):
        e = tl.load(ids_ptr + t * TOP_K + j) - expert_start
        if (e >= 0) & (e < num_local):  # another rank's pair wrote no row
            wt = tl.load(tw_ptr + t * TOP_K + j)  # float32: HF's weight times rounded row
            if HAS_MAP:  # the rows in another order (kernels/moe_grouped_gemm.py)
                r = tl.load(map_ptr + t * TOP_K + j).to(tl.int64)
            else:
                r = t * TOP_K + j
            row = tl.load(y_ptr + r * s_y + cols, mask=mask, other=0.0)
            acc += row.to(tl.float32) * wt
    tl.store(out_ptr + t * s_o + cols, acc.to(out_ptr.dtype.element_ty), mask=mask)


def fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
              topk_weights: torch.Tensor, topk_ids: torch.Tensor,
              expert_start: int = 0, config: dict[str, Any] | None = None,
              w13_scale: torch.Tensor | None = None,
              w2_scale: torch.Tensor | None = None) -> torch.Tensor:
    """x: [T, H]; w13: [E_local, 2I, H]; w2: [E_local, H, I]; topk_weights: [T, k]
    float32; topk_ids: [T, k] int32/int64 global ids; config: tile sizes (default: the
    table's). Returns [T, H] in x's dtype.
    FP8 experts: w13, w2 float8_e4m3fn with float32 scales w13_scale [E_local, 2I, G13]
    and w2_scale [E_local, H, G2] that multiply them (G = 1: per output channel; G > 1:
    each row's scale per K / G columns, the rows of a block-scaled checkpoint's block
    repeating its scale). The weight tile is widened to x's dtype after its load and the
    scales multiply the accumulator (weight-only: x is never quantized)."""
    out = _fused_moe(x, w13, w2, topk_weights, topk_ids, expert_start, config, w13_scale,
                     w2_scale, None)
    assert isinstance(out, torch.Tensor)  # no next_norm: the MoE output
    return out


def down_sum_applies(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, fp8: bool) -> bool:
    """Whether fused_moe's call on x runs down and sum as one launch (DOWN_SUM_MAX_TOKENS:
    the per-pair layout at few tokens, no prefill form taking the call first)."""
    t = x.shape[0]
    return (0 < t <= PER_PAIR_MAX_TOKENS and t <= DOWN_SUM_MAX_TOKENS
            and not grouped_applies(x, w13, w2, fp8, t) and not tma_applies(x, w13, w2, fp8, t))


def fused_moe_next_norm(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                        topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                        expert_start: int, norm_weight: torch.Tensor, eps: float,
                        residual: torch.Tensor, w13_scale: torch.Tensor | None = None,
                        w2_scale: torch.Tensor | None = None
                        ) -> tuple[torch.Tensor, torch.Tensor] | None:
    """rms_norm(fused_moe(x, ...), norm_weight, eps, residual) with the norm inside the
    down + sum launch (kernels/triton_moe_down_sum.py's next_norm): (normed, new_residual)
    [T, H] in x's dtype (residual's, which must match), or None, having launched nothing,
    where that launch is not fused_moe's path for the call (down_sum_applies)."""
    if not down_sum_applies(x, w13, w2, w2_scale is not None):
        return None
    out = _fused_moe(x, w13, w2, topk_weights, topk_ids, expert_start, None, w13_scale,
                     w2_scale, (norm_weight, eps, residual))
    assert isinstance(out, tuple)  # down_sum_applies: the down + sum launch ran
    return out


def _fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
               topk_weights: torch.Tensor, topk_ids: torch.Tensor, expert_start: int,
               config: dict[str, Any] | None, w13_scale: torch.Tensor | None,
               w2_scale: torch.Tensor | None,
               next_norm: tuple[torch.Tensor, float, torch.Tensor] | None
               ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """fused_moe; next_norm (the caller has checked down_sum_applies): down_sum's, the
    result then (normed, new_residual)."""
    check(x.dim() == 2, "x: expected [T, H]")
    check(w13.dim() == 3 and w2.dim() == 3, "w13, w2: expected [E, 2I, H], [E, H, I]")
    t, h = x.shape
    e_local, two_i, _ = w13.shape
    inter = two_i // 2
    check(tuple(w13.shape) == (e_local, 2 * inter, h) and two_i % 2 == 0,
          f"w13: expected [E, 2I, {h}], got {tuple(w13.shape)}")
    check(tuple(w2.shape) == (e_local, h, inter),
          f"w2: expected {(e_local, h, inter)}, got {tuple(w2.shape)}")
    check(topk_ids.dim() == 2 and topk_ids.shape[0] == t, "topk_ids: expected [T, k]")
    check(tuple(topk_weights.shape) == tuple(topk_ids.shape),
          "topk_weights: expected the shape of topk_ids")
    check(topk_weights.dtype == torch.float32, "topk_weights: expected float32")
    check_float("x", x)
    fp8 = w13_scale is not None or w2_scale is not None
    if fp8:
        check(w13_scale is not None and w2_scale is not None,
              "w13_scale, w2_scale: FP8 experts need both")
        assert w13_scale is not None and w2_scale is not None
        check(w13.dtype == FP8 and w2.dtype == FP8,
              f"w13, w2: scales given, expected float8_e4m3fn, got {w13.dtype}, {w2.dtype}")
    else:
        check(w13.dtype == x.dtype and w2.dtype == x.dtype, "w13, w2: expected x's dtype")
    check_int("topk_ids", topk_ids)
    check_device(x, w13, w2, topk_weights, topk_ids)
    for name, ten in (("x", x), ("w13", w13), ("w2", w2)):
        check(ten.stride(-1) == 1, f"{name}: rows must be contiguous")
    g13 = scale_groups("w13_scale", w13_scale, w13) if w13_scale is not None else 1
    g2 = scale_groups("w2_scale", w2_scale, w2) if w2_scale is not None else 1
    k = topk_ids.shape[1]
    # the GEMMs' int32 offsets: token rows of x, pair rows of the activation, one expert
    check(t * x.stride(0) < 2**31 and t * k * inter < 2**31 and w13.stride(0) < 2**31
          and w2.stride(0) < 2**31, "x, w13, w2: too large for the kernel's int32 offsets")
    out = torch.empty(t, h, dtype=x.dtype, device=x.device)
    if t == 0:
        return out
    ids = topk_ids.contiguous()
    weights = topk_weights.contiguous()
    if config is None and grouped_applies(x, w13, w2, fp8, t):  # kernels/moe_grouped_gemm.py
        ys, row_of_pair = expert_rows_grouped(x, w13, w2, ids, expert_start)
        _sum_topk(ys, ids, weights, out, expert_start, e_local, pdl=False,
                  row_of_pair=row_of_pair)
        return out
    if config is None and tma_applies(x, w13, w2, fp8, t):  # prefill: kernels/triton_moe_tma.py
        _sum_topk(expert_rows(x, w13, w2, ids, expert_start), ids, weights, out,
                  expert_start, e_local, pdl=False)
        return out
    cfg = config or tile_config(t, x.device, w13.element_size())
    bm, bn, bk = cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["BLOCK_K"]
    launch = {"num_warps": cfg.get("num_warps", 4), "num_stages": cfg.get("num_stages", 2)}
    n = t * k
    pdl = pdl_for(x)
    per_pair = t <= PER_PAIR_MAX_TOKENS
    if per_pair and config is None and PER_PAIR_BLOCK_N is not None:
        bn = PER_PAIR_BLOCK_N
    if per_pair:  # tile i is pair i (the kernels read ids; these two are not read)
        sorted_ids = block_expert = ids
        tiles_m = n
    else:
        align = moe_align_triton if one_program(n) else moe_align_multi
        sorted_ids, block_expert = align(ids, bm, expert_start, e_local)
        tiles_m = block_expert.shape[0]
    dot = compute_dtype(x)
    ieee = x.dtype == torch.float32
    gk13, gk2 = h // g13, inter // g2  # a constexpr only where there are groups
    if g13 > 1:  # a K tile inside one scale group
        bk = min(bk, gk13)
        # block scales hold each K tile's product apart from the two accumulators; past
        # this many outputs per tile ptxas spills it (sm_90, tests/kernels/test_moe_sm90.py)
        bn = min(bn, max(16, BLOCK_SCALED_GATE_UP_TILE // bm))
    s13 = w13_scale if w13_scale is not None else x  # an unread pointer without scales
    act = torch.empty(n, inter, dtype=x.dtype, device=x.device)  # [T*k, I], by pair
    if per_pair and config is None and t <= GATE_UP_GEMV_MAX_TOKENS:
        # a given config names _gate_up_kernel's tiles: it keeps that kernel
        gate_up_gemv(x, w13, act, ids, expert_start, w13_scale, pdl)
    else:
        _gate_up_kernel[(tiles_m, triton.cdiv(inter, bn))](
            x, w13, act, sorted_ids, block_expert, s13, ids, n, h, inter, k, expert_start,
            e_local, x.stride(0), w13.stride(0), w13.stride(1), act.stride(0),
            s13.stride(0) if fp8 else 0, s13.stride(1) if fp8 else 0,
            BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, DOT_DTYPE=dot, IEEE=ieee, EVEN_K=h % bk == 0,
            SCALED=fp8, GROUP_K=gk13 if g13 > 1 else 1, ONE_GROUP=g13 == 1, PDL=pdl,
            PER_PAIR=per_pair, launch_pdl=pdl, **launch)
    if per_pair and t <= DOWN_SUM_MAX_TOKENS:  # steps 3 and 4 in one launch, no row buffer
        normed = down_sum(act, w2, ids, weights, out, expert_start, w2_scale, pdl, next_norm)
        return out if normed is None else normed
    y = torch.empty(n, h, dtype=x.dtype, device=x.device)  # [T*k, H] rows, unweighted
    bn2, bk2 = cfg.get("BLOCK_N_DOWN", bn), cfg.get("BLOCK_K_DOWN", bk)
    if g2 > 1:
        bk2 = min(bk2, gk2)
    s2 = w2_scale if w2_scale is not None else x
    _down_kernel[(tiles_m, triton.cdiv(h, bn2))](
        act, w2, y, sorted_ids, block_expert, s2, ids, n, h, inter, expert_start,
        e_local,
        act.stride(0), w2.stride(0), w2.stride(1), y.stride(0),
        s2.stride(0) if fp8 else 0, s2.stride(1) if fp8 else 0,
        BLOCK_M=bm, BLOCK_N=bn2, BLOCK_K=bk2, DOT_DTYPE=dot, IEEE=ieee,
        EVEN_K=inter % bk2 == 0, SCALED=fp8, GROUP_K=gk2 if g2 > 1 else 1, ONE_GROUP=g2 == 1,
        PDL=pdl, PER_PAIR=per_pair, launch_pdl=pdl, **launch)
    _sum_topk(y, ids, weights, out, expert_start, e_local, pdl)
    return out


def _sum_topk(y: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, out: torch.Tensor,
              expert_start: int, e_local: int, pdl: bool,
              row_of_pair: torch.Tensor | None = None) -> None:
    """Step 4: out[t] = sum over j of weights[t, j] * y[t * k + j] (this rank's pairs), or
    of y[row_of_pair[t * k + j]] where the rows are in another order."""
    t, h = out.shape
    block_h = min(1024, triton.next_power_of_2(h))
    rmap = row_of_pair if row_of_pair is not None else ids  # an unread pointer without one
    _sum_topk_kernel[(t, triton.cdiv(h, block_h))](
        y, ids, weights, out, rmap, h, ids.shape[1], expert_start, e_local, y.stride(0),
        out.stride(0), BLOCK_H=block_h, HAS_MAP=row_of_pair is not None, PDL=pdl,
        num_warps=4, launch_pdl=pdl)
