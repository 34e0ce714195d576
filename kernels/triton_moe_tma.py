"""Prefill-sized calls of the fused MoE kernel (kernels/triton_moe.py) with tensor-memory
(TMA) loads: steps 1-3 of its four, the expert-sorted GEMMs, on contiguous operands.

Why a second form of the same GEMMs: at prefill the experts are most of a DeepSeek-V2-Lite
step (4,096 tokens: ~36 of ~57 ms of kernels on an H200, bench/RESULTS.md), and the
decode-shaped kernels run them at ~325 TFLOP/s, 42% of the bf16 matmul rate. They load
their row tiles through a gather (each row's token, int32 offset tiles into x). Here every
operand tile is one rectangle of a 2-D tensor, loaded by the copy engine into shared memory
(a descriptor per operand, no address registers per element):
1. align (as the decode form; kernels/triton_moe_align.py), then `_gather_kernel` copies
   each sorted row's token row of x into `xs` [P, H] (padding rows zero, tiles past the
   experts' runs untouched), so a row tile of one expert is rows [m * BM, (m + 1) * BM);
2. gate/up: xs tiles against w13 viewed as [E * 2I, H] (the expert's gate rows at e * 2I,
   its up rows I further), silu(gate) * up stored to `act` [P, I] in the same sorted rows;
3. down: act tiles against w2 viewed as [E * H, I]; each real row's output goes to its
   pair's row of y [T * k, H], which fused_moe's sum step reads as before.
Tiles that would run past an expert's rows (I or H not a multiple of the tile) read the next
rows or the descriptor's zero fill; those columns are masked at the store. The cost over
the decode form is the gather (a write and read of [P, H]) and one launch.

Taken for 16-bit experts on sm_90+ at MIN_TOKENS tokens or more; FP8 experts, float32 and
decode-sized calls keep the decode form (which a CUDA graph can capture: this form makes a
descriptor per call on the host).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from kernels.triton_common import check, compute_dtype
from kernels.triton_moe_align import moe_align_multi, moe_align_triton, one_program

# Calls with at least this many tokens take this form; None: none does (the decode form
# serves every call). Off: timed on an H100 (bench/RESULTS.md, "The experts' prefill GEMMs
# with tensor-memory loads"), its best tiles ran V2-Lite's 4,096-token experts 3% faster
# than the decode form's untuned default tile, where the H200's tuned decode tile is 12%
# faster than that default; the whole prefill, at its first (8-warp) tiles, was 2-4% slower.
MIN_TOKENS: int | None = None


# The tiles (module constants, so a benchmark variant can set each one): BLOCK_M is the
# expert-sorted row tile of both GEMMs; gate/up holds two [BLOCK_M, BLOCK_N] accumulators
# (gate and up), down one [BLOCK_M, BLOCK_N_DOWN]. The fastest of bench/moe_tune.py's
# TMA_CANDIDATES on an H100 (16 warps: four warpgroups share each tile's accumulators);
# compiled for sm_90 they do not spill (tests/kernels/test_moe_tma_sm90.py).
BLOCK_M = 128
BLOCK_N = 128
BLOCK_K = 64
NUM_WARPS = 16
NUM_STAGES = 3
BLOCK_N_DOWN = 256
BLOCK_K_DOWN = 64
NUM_WARPS_DOWN = 16
NUM_STAGES_DOWN = 3


@dataclass(frozen=True)
class Tiles:
    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    block_n_down: int
    block_k_down: int
    num_warps_down: int
    num_stages_down: int


def current_tiles() -> Tiles:
    """The module constants' tiles, read at each call."""
    return Tiles(BLOCK_M, BLOCK_N, BLOCK_K, NUM_WARPS, NUM_STAGES, BLOCK_N_DOWN, BLOCK_K_DOWN,
                 NUM_WARPS_DOWN, NUM_STAGES_DOWN)


GATHER_ROWS = 16  # rows per gather program (divides every BLOCK_M: a program is one tile's)
GATHER_COLS = 512


def applies(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, fp8: bool,
            num_tokens: int) -> bool:
    """Whether fused_moe takes this form for the call."""
    if MIN_TOKENS is None or num_tokens < MIN_TOKENS or fp8:
        return False
    if x.dtype not in (torch.bfloat16, torch.float16) or not x.is_cuda:
        return False
    if torch.cuda.get_device_capability(x.device) < (9, 0):  # no tensor-memory copies
        return False
    # a descriptor's row stride is 16-byte aligned, its base too
    return all(t.is_contiguous() and t.data_ptr() % 16 == 0 and (t.shape[-1] * 2) % 16 == 0
               for t in (x, w13, w2))


@triton.jit
def _gather_kernel(x_ptr, sorted_ptr, bexp_ptr, xs_ptr, N, H, TOP_K, s_x, s_xs,
                   BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_H: tl.constexpr):
    """xs[r] = x[pair // TOP_K] for the sorted rows r of this program (zero on padding);
    rows of tiles past the experts' runs are left as they are (no GEMM reads them)."""
    r0 = tl.program_id(0) * BLOCK_R
    if tl.load(bexp_ptr + r0 // BLOCK_M) < 0:
        return
    rows = r0 + tl.arange(0, BLOCK_R)
    pair = tl.load(sorted_ptr + rows)
    ok = pair < N
    tok = tl.where(ok, pair // TOP_K, 0).to(tl.int64)
    for h0 in range(0, H, BLOCK_H):
        cols = h0 + tl.arange(0, BLOCK_H)
        col_ok = cols < H
        v = tl.load(x_ptr + tok[:, None] * s_x + cols[None, :], mask=ok[:, None] & col_ok[None, :],
                    other=0.0)
        tl.store(xs_ptr + rows[:, None].to(tl.int64) * s_xs + cols[None, :], v,
                 mask=col_ok[None, :])


@triton.jit
def _gate_up_kernel(xs_desc, w_desc, act_ptr, bexp_ptr, INTER, H, s_o,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                    DOT_DTYPE: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    e = tl.load(bexp_ptr + pid_m)
    if e < 0:  # past the experts' padded runs
        return
    row0 = pid_m * BLOCK_M
    gate0 = e * 2 * INTER + pid_n * BLOCK_N  # this tile's gate rows of the [E * 2I, H] view
    up0 = gate0 + INTER
    acc_g = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, H, BLOCK_K):
        a = xs_desc.load([row0, k0]).to(DOT_DTYPE)  # [BM, BK]
        g = w_desc.load([gate0, k0]).to(DOT_DTYPE)  # [BN, BK]
        u = w_desc.load([up0, k0]).to(DOT_DTYPE)
        acc_g = tl.dot(a, g.T, acc_g)
        acc_u = tl.dot(a, u.T, acc_u)
    # as the decode form: gate and up rounded to the storage dtype (HF's unfused linears),
    # then the activation, rounded once more
    g_r = acc_g.to(act_ptr.dtype.element_ty).to(tl.float32)
    u_r = acc_u.to(act_ptr.dtype.element_ty).to(tl.float32)
    act = g_r / (1.0 + tl.exp(-g_r)) * u_r
    rows = row0 + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    tl.store(act_ptr + rows[:, None].to(tl.int64) * s_o + cols[None, :],
             act.to(act_ptr.dtype.element_ty), mask=(cols < INTER)[None, :])


@triton.jit
def _down_kernel(act_desc, w_desc, y_ptr, sorted_ptr, bexp_ptr, N, H, INTER, s_y,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 DOT_DTYPE: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    e = tl.load(bexp_ptr + pid_m)
    if e < 0:
        return
    row0 = pid_m * BLOCK_M
    w0 = e * H + pid_n * BLOCK_N  # this tile's rows of the [E * H, I] view
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, INTER, BLOCK_K):
        a = act_desc.load([row0, k0]).to(DOT_DTYPE)  # [BM, BK]
        w = w_desc.load([w0, k0]).to(DOT_DTYPE)  # [BN, BK]
        acc = tl.dot(a, w.T, acc)
    pair = tl.load(sorted_ptr + row0 + tl.arange(0, BLOCK_M))
    ok = pair < N
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    # each real row's output, rounded as HF's expert returns it, to its pair's row
    tl.store(y_ptr + tl.where(ok, pair, 0).to(tl.int64)[:, None] * s_y + cols[None, :],
             acc.to(y_ptr.dtype.element_ty), mask=ok[:, None] & (cols < H)[None, :])


def gather_sorted_rows(x: torch.Tensor, sorted_ids: torch.Tensor, block_expert: torch.Tensor,
                       top_k: int, block_m: int) -> torch.Tensor:
    """xs [P, H]: row r is x[sorted_ids[r] // top_k], zero where the row is padding; rows
    of tiles past the experts' runs (block_expert -1) are left unwritten. The align step's
    layout (kernels/triton_moe_align.py) with block_m a multiple of GATHER_ROWS."""
    check(block_m % GATHER_ROWS == 0, f"block_m: {block_m} is not a multiple of {GATHER_ROWS}")
    p, h = sorted_ids.shape[0], x.shape[1]
    xs = torch.empty(p, h, dtype=x.dtype, device=x.device)
    _gather_kernel[(p // GATHER_ROWS,)](
        x, sorted_ids, block_expert, xs, x.shape[0] * top_k, h, top_k, x.stride(0),
        xs.stride(0), BLOCK_M=block_m, BLOCK_R=GATHER_ROWS,
        BLOCK_H=min(GATHER_COLS, triton.next_power_of_2(h)), num_warps=4)
    return xs


def expert_rows(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, ids: torch.Tensor,
                expert_start: int, tiles: Tiles | None = None) -> torch.Tensor:
    """x [T, H]; w13 [E_local, 2I, H]; w2 [E_local, H, I]; ids [T, k] global expert ids.
    Returns y [T * k, H]: row t * k + j is expert ids[t, j]'s output for token t, rounded to
    x's dtype (rows of other ranks' experts unwritten): fused_moe's rows before its sum."""
    tile = tiles or current_tiles()
    t, h = x.shape
    e_local, two_i, _ = w13.shape
    inter = two_i // 2
    k = ids.shape[1]
    n = t * k
    check(w13.is_contiguous() and w2.is_contiguous() and x.stride(1) == 1,
          "x, w13, w2: expected contiguous rows (the tensor-memory form)")
    check(ids.is_contiguous(), "topk_ids: expected contiguous")
    bm = tile.block_m
    check(bm % GATHER_ROWS == 0, f"block_m: {bm} is not a multiple of {GATHER_ROWS}")
    align = moe_align_triton if one_program(n) else moe_align_multi
    sorted_ids, block_expert = align(ids, bm, expert_start, e_local)
    p = sorted_ids.shape[0]
    tiles_m = block_expert.shape[0]
    xs = gather_sorted_rows(x, sorted_ids, block_expert, k, bm)
    dot = compute_dtype(x)
    act = torch.empty(p, inter, dtype=x.dtype, device=x.device)
    bn, bk = tile.block_n, tile.block_k
    _gate_up_kernel[(tiles_m, triton.cdiv(inter, bn))](
        TensorDescriptor(xs, [p, h], [h, 1], [bm, bk]),
        TensorDescriptor(w13, [e_local * two_i, h], [h, 1], [bn, bk]),
        act, block_expert, inter, h, act.stride(0),
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, DOT_DTYPE=dot, num_warps=tile.num_warps,
        num_stages=tile.num_stages)
    y = torch.empty(n, h, dtype=x.dtype, device=x.device)
    bn2, bk2 = tile.block_n_down, tile.block_k_down
    _down_kernel[(tiles_m, triton.cdiv(h, bn2))](
        TensorDescriptor(act, [p, inter], [inter, 1], [bm, bk2]),
        TensorDescriptor(w2, [e_local * h, inter], [inter, 1], [bn2, bk2]),
        y, sorted_ids, block_expert, n, h, inter, y.stride(0),
        BLOCK_M=bm, BLOCK_N=bn2, BLOCK_K=bk2, DOT_DTYPE=dot, num_warps=tile.num_warps_down,
        num_stages=tile.num_stages_down)
    return y
