"""Triton FP8 x FP8 GEMM split along K, for the rows between weight-only decode and prefill.

Reference: kernels/ref_fp8.fp8_gemm_ref (one scale group). xq [M, K] float8 with one scale
per row times w [N, K] float8 with one scale per output channel. Above the weight-only
kernel's rows (engine/quant/fp8_linear.WEIGHT_ONLY_MAX_ROWS) and up to a few hundred, a
decode batch's product is still small: cuBLAS's row-wise scaled mm tiles it 128 x 128 and
does not split K, so at batch 128 an 8B model's o_proj and down_proj (N = 4096) run on 32
of an H200's 132 SMs and qkv_proj on 48 (bench/fp8_bench.py --sections profile: FP8's four
projections 3.27 ms a step against ~1.6 ms of weight bytes). Here a program owns one
[BLOCK_M, BLOCK_N] output tile and one of S slices of K, S chosen so the grid fills the
GPU, and leaves float32 partial sums that the kernel reading the output adds
(engine/models/split_k.py: RMSNorm, RoPE + KV store), as the weight-only kernel does at
fewer rows. The scales are one per row and one per column, so they multiply each slice's
sum once, in the epilogue: sa[m] * sb[n] * sum over the slice of xq * w.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from kernels.pdl import follow, launch_dependents, pdl_for, wait
from kernels.triton_common import check

FP8 = torch.float8_e4m3fn
BLOCK_N = 128
BLOCK_K = 64
NUM_STAGES = 4
# 8 warps at every row tile: at 4, the 32- and 64-row tiles spill (ptxas, sm_90).
NUM_WARPS = 8
# Programs per SM the split count aims for: one wave of full-K-slice programs.
PROGRAMS_PER_SM = 1
# The fewest K tiles a slice keeps, so the pipelined loop fills.
MIN_K_TILES = 16
MAX_SPLITS = 8
# When this kernel lets the next one start under PDL (kernels/pdl.py): "early" (right after
# its wait, as every other PDL kernel here), "late" (after its store: the next kernel's
# waiting programs then take no SM room from this one's), or "off" (launched without PDL).
# On an H200, 8B dummy, graphed step, one interleaved call (bench/fp8_bench.py --sections
# pdl, 2026-12-04): batch 48 early 5.51 / late 5.32 / off 5.37 ms, 64 5.90 / 5.90 / 5.75,
# 128 7.09 / 7.06 / 7.15. Late was never slower than early.
PDL_DEPENDENTS = "late"


@triton.jit
def _split_gemm_kernel(a_ptr, as_ptr, b_ptr, bs_ptr, c_ptr, M, N, K, k_per_split,
                       s_am, s_asm, s_bn, s_bsn, s_cs, s_cm,
                       FP8_DOT: tl.constexpr, EVEN_K: tl.constexpr, PDL: tl.constexpr,
                       LATE: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    if PDL:  # xq is the kernel before's output; c may reuse its memory (kernels/pdl.py)
        if LATE:
            wait()
        else:
            follow()
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    split = tl.program_id(2)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    k0 = split * k_per_split
    k1 = tl.minimum(K, k0 + k_per_split)
    # Rows past M and columns past N load a valid row again (wrapped) instead of being
    # masked, and are dropped at the store: a [BLOCK_M, BLOCK_K] mask per load cost
    # registers the tile could not spare (ptxas, sm_90: 1.5 KB of spills at 128 x 128).
    # The pointers advance by BLOCK_K rather than being rebuilt each tile, for the same reason.
    a_ptrs = a_ptr + (rm % M)[:, None].to(tl.int64) * s_am + (k0 + rk)[None, :]
    b_ptrs = b_ptr + (rn % N)[:, None].to(tl.int64) * s_bn + (k0 + rk)[None, :]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kk in range(k0, k1, BLOCK_K):
        if EVEN_K:  # every slice is whole tiles
            a = tl.load(a_ptrs)
            b = tl.load(b_ptrs)
        else:
            k_ok = (kk + rk)[None, :] < k1
            a = tl.load(a_ptrs, mask=k_ok, other=0.0)
            b = tl.load(b_ptrs, mask=k_ok, other=0.0)
        if FP8_DOT:
            acc += tl.dot(a, tl.trans(b))
        else:  # the interpreter has no FP8 product
            acc += tl.dot(a.to(tl.float32), tl.trans(b.to(tl.float32)))
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K
    m_ok = rm < M
    n_ok = rn < N
    sa = tl.load(as_ptr + rm * s_asm, mask=m_ok, other=0.0)
    sb = tl.load(bs_ptr + rn * s_bsn, mask=n_ok, other=0.0)
    acc = acc * sa[:, None] * sb[None, :]
    ptrs = c_ptr + split.to(tl.int64) * s_cs + rm[:, None].to(tl.int64) * s_cm + rn[None, :]
    tl.store(ptrs, acc.to(c_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])
    if PDL and LATE:
        launch_dependents()


@functools.cache
def _sm_count(index: int) -> int:
    return int(torch.cuda.get_device_properties(index).multi_processor_count)


def block_m(m: int) -> int:
    """Rows per tile: the batch in one tile up to 128 (at least 16, the MMA's least)."""
    return min(128, max(16, triton.next_power_of_2(m)))


def choose_splits(m: int, n: int, k: int, sms: int) -> int:
    """K slices that bring the grid to PROGRAMS_PER_SM programs per SM, each of at least
    MIN_K_TILES tiles, at most MAX_SPLITS. A 128-row tile's program holds a 128 x 128
    float32 accumulator, so only one fits an SM at a time: there the grid stays within one
    wave (rounded down), since a second wave of a few programs costs as long as the first.
    On an H200 at 128 rows, down_proj (32 column tiles) took 45.7 us as 5 slices (160
    programs) against cuBLAS's 37.0 (bench/fp8_bench.py --sections gemm, 2026-12-04)."""
    bm = block_m(m)
    tiles = triton.cdiv(m, bm) * triton.cdiv(n, BLOCK_N)
    if bm == 128:
        want = PROGRAMS_PER_SM * sms // tiles
    else:
        want = triton.cdiv(PROGRAMS_PER_SM * sms, tiles)
    return max(1, min(want, MAX_SPLITS, (k // BLOCK_K) // MIN_K_TILES))


def auto_splits(xq: torch.Tensor, n: int) -> int:
    """choose_splits on xq's device (1 off CUDA)."""
    if not xq.is_cuda:
        return 1
    return choose_splits(xq.shape[0], n, xq.shape[1], _sm_count(xq.device.index or 0))


def fp8_split_gemm(xq: torch.Tensor, x_scale: torch.Tensor, w: torch.Tensor,
                   w_scale: torch.Tensor, splits: int, out_dtype: torch.dtype) -> torch.Tensor:
    """xq [M, K] float8 with x_scale [M, 1] float32, w [N, K] float8 with w_scale [N, 1]
    float32 -> [M, N] out_dtype (splits == 1) or [splits, M, N] float32 partial sums, each
    over about K / splits columns (whole BLOCK_K tiles; a slice past K is zeros)."""
    check(xq.dim() == 2 and w.dim() == 2 and xq.shape[1] == w.shape[1],
          "xq [M, K] and w [N, K] must share K")
    check(xq.dtype == FP8 and w.dtype == FP8, "xq, w: expected float8_e4m3fn")
    m, k = xq.shape
    n = w.shape[0]
    check(tuple(x_scale.shape) == (m, 1) and tuple(w_scale.shape) == (n, 1),
          f"x_scale [M, 1] = {(m, 1)}, w_scale [N, 1] = {(n, 1)}: got "
          f"{tuple(x_scale.shape)}, {tuple(w_scale.shape)}")
    check(x_scale.dtype == torch.float32 and w_scale.dtype == torch.float32,
          "x_scale, w_scale: expected float32")
    check(xq.stride(1) == 1 and w.stride(1) == 1, "xq, w: rows must be contiguous")
    check(splits >= 1, f"splits: expected >= 1, got {splits}")
    tiles_k = triton.cdiv(k, BLOCK_K)
    k_per_split = triton.cdiv(tiles_k, splits) * BLOCK_K
    if splits == 1:
        out = torch.empty(m, n, dtype=out_dtype, device=xq.device)
    else:  # a slice that starts past K (more slices than tiles) stores zeros
        out = torch.empty(splits, m, n, dtype=torch.float32, device=xq.device)
    s_cs = out.stride(0) if splits > 1 else 0
    if m == 0:
        return out
    bm = block_m(m)
    pdl = pdl_for(xq) and PDL_DEPENDENTS != "off"
    grid = (triton.cdiv(n, BLOCK_N), triton.cdiv(m, bm), splits)
    _split_gemm_kernel[grid](
        xq, x_scale, w, w_scale, out, m, n, k, k_per_split,
        xq.stride(0), x_scale.stride(0), w.stride(0), w_scale.stride(0), s_cs,
        out.stride(-2),
        FP8_DOT=xq.is_cuda, EVEN_K=k % BLOCK_K == 0, PDL=pdl,
        LATE=PDL_DEPENDENTS == "late",
        BLOCK_M=bm, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K,
        num_warps=NUM_WARPS, num_stages=NUM_STAGES,
        launch_pdl=pdl)
    return out
