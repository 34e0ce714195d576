"""Triton FP8 x FP8 GEMM with scales applied per K group, and the activation quantizer.

Reference: kernels/ref_fp8.fp8_gemm_ref and quant_rows (same signatures). xq [M, K] with
x_scale [M, G] times w [N, K] with w_scale [N, G]: each BLOCK_K tile's FP8 product (float32
accumulate on the tensor cores) is scaled by its rows' and columns' group scales, which is
what block-wise checkpoints (DeepSeek-V3, Qwen3-FP8: 128 x 128 weight blocks, 1 x 128
activation groups) need. With G == 1 on CUDA, `fp8_gemm` uses torch._scaled_mm (cuBLAS,
row-wise scales) instead.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.triton_common import check, check_float

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
MIN_SCALE = 1e-12
# cuBLAS's FP8 fast accumulation: the tensor cores' partial sums are not promoted to full
# float32 every few K steps (vLLM's Hopper FP8 GEMMs run so). On an H200 it takes an 8B
# model's 4k-token prefill from 71.8 to 65.0 ms (1.44x -> 1.59x bf16). What it costs, priced
# on the GPU (bench/RESULTS.md, "cuBLAS's fast FP8 accumulation, priced", 2026-12-04): per
# 8B projection it adds 0.06-0.20 points of relative error to FP8's 3.6 (bf16's own output
# rounding is 0.17; bench/fp8_accum_error.py), and the real SmolLM2 with it keeps bf16's
# token at 91.0% of the teacher-forced positions (91.4% without) with perplexity 1.006x
# bf16 (1.020x without; bench/fp8_accuracy.py --device cuda).
FAST_ACCUM = True


@triton.jit
def _gemm_kernel(a_ptr, as_ptr, b_ptr, bs_ptr, c_ptr, M, N, K, s_am, s_asm, s_bn, s_bsn, s_bsg,
                 s_cm,
                 GROUP_K: tl.constexpr, FP8_DOT: tl.constexpr, BLOCK_M: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
    pid = tl.program_id(0)
    grid_m = tl.cdiv(M, BLOCK_M)
    grid_n = tl.cdiv(N, BLOCK_N)
    # grouped order: GROUP_M row tiles share each weight tile while it is in L2
    per_group = GROUP_M * grid_n
    first_m = (pid // per_group) * GROUP_M
    size_m = tl.minimum(grid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % size_m
    pid_n = (pid % per_group) // size_m
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    m_ok = rm < M
    n_ok = rn < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kk in range(0, K, BLOCK_K):
        ks = kk + rk
        k_ok = ks < K
        a = tl.load(a_ptr + rm[:, None].to(tl.int64) * s_am + ks[None, :],
                    mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(b_ptr + rn[:, None].to(tl.int64) * s_bn + ks[None, :],
                    mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        g = kk // GROUP_K
        sa = tl.load(as_ptr + rm * s_asm + g, mask=m_ok, other=0.0)
        sb = tl.load(bs_ptr + rn * s_bsn + g * s_bsg, mask=n_ok, other=0.0)
        if FP8_DOT:
            d = tl.dot(a, tl.trans(b))
        else:  # the interpreter has no FP8 product
            d = tl.dot(a.to(tl.float32), tl.trans(b.to(tl.float32)))
        acc += d * sa[:, None] * sb[None, :]
    ptrs = c_ptr + rm[:, None].to(tl.int64) * s_cm + rn[None, :]
    tl.store(ptrs, acc.to(c_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


def fp8_block_gemm(xq: torch.Tensor, x_scale: torch.Tensor, w: torch.Tensor,
                   w_scale: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """The Triton kernel for any G (see the module docstring). w_scale may be a per-channel
    [N, 1] scale expanded to [N, G] (stride 0): x then keeps group scales."""
    m, k = xq.shape
    n = w.shape[0]
    g = w_scale.shape[1]
    check(xq.dtype == FP8 and w.dtype == FP8, "xq, w: expected float8_e4m3fn")
    check(w.shape[1] == k and k % g == 0, "xq [M, K], w [N, K]: K must match and G divide it")
    check(tuple(x_scale.shape) == (m, g) and w_scale.shape[0] == n,
          f"x_scale [M, G] = {(m, g)} and w_scale [N, G]: shapes disagree")
    check(xq.stride(1) == 1 and w.stride(1) == 1 and x_scale.stride(1) == 1,
          "xq, w, x_scale: rows must be contiguous")
    gk = k // g
    block_k = 128 if g == 1 else min(128, gk)
    check(g == 1 or gk % block_k == 0, f"scale groups of {gk} columns: not a multiple of "
          f"{block_k}")
    out = torch.empty(m, n, dtype=out_dtype, device=xq.device)
    if m == 0:
        return out
    grid = (triton.cdiv(m, 128) * triton.cdiv(n, 128),)
    fp8_dot = xq.is_cuda
    _gemm_kernel[grid](xq, x_scale, w, w_scale, out, m, n, k, xq.stride(0), x_scale.stride(0),
                       w.stride(0), w_scale.stride(0), w_scale.stride(1), out.stride(0),
                       GROUP_K=gk,
                       FP8_DOT=fp8_dot, BLOCK_M=128, BLOCK_N=128, BLOCK_K=block_k, GROUP_M=8,
                       num_warps=8, num_stages=3)
    return out


def fp8_gemm(xq: torch.Tensor, x_scale: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor,
             out_dtype: torch.dtype) -> torch.Tensor:
    """[M, N] out_dtype; per-row x per-channel scales in bf16/fp16 go to cuBLAS (which
    needs K and N multiples of 16)."""
    if (w_scale.shape[1] == 1 and xq.is_cuda and out_dtype in (torch.bfloat16, torch.float16)
            and xq.shape[0] > 0 and xq.shape[1] % 16 == 0 and w.shape[0] % 16 == 0):
        return torch._scaled_mm(xq, w.t(), scale_a=x_scale.float().contiguous(),
                                scale_b=w_scale.float().reshape(1, -1),
                                out_dtype=out_dtype, use_fast_accum=FAST_ACCUM)
    return fp8_block_gemm(xq, x_scale, w, w_scale, out_dtype)


@triton.jit
def _quant_kernel(x_ptr, q_ptr, s_ptr, GK, s_xm, s_qm, s_sm, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    g = tl.program_id(1)
    cols = g * GK + tl.arange(0, BLOCK)
    ok = tl.arange(0, BLOCK) < GK
    x = tl.load(x_ptr + row * s_xm + cols, mask=ok, other=0.0).to(tl.float32)
    scale = tl.maximum(tl.max(tl.abs(x), axis=0) / 448.0, 1e-12)
    q = tl.minimum(tl.maximum(x / scale, -448.0), 448.0)
    tl.store(q_ptr + row * s_qm + cols, q.to(q_ptr.dtype.element_ty), mask=ok)
    tl.store(s_ptr + row * s_sm + g, scale)


def quant_rows(x: torch.Tensor, groups: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One launch: x [M, K] -> (xq float8_e4m3fn [M, K], scale float32 [M, groups])."""
    check(x.dim() == 2 and x.shape[1] % groups == 0, "x: expected [M, K] with groups | K")
    check_float("x", x)
    check(x.stride(1) == 1, "x: rows must be contiguous")
    m, k = x.shape
    q = torch.empty(m, k, dtype=FP8, device=x.device)
    s = torch.empty(m, groups, dtype=torch.float32, device=x.device)
    if m == 0:
        return q, s
    gk = k // groups
    block = triton.next_power_of_2(gk)
    _quant_kernel[(m, groups)](x, q, s, gk, x.stride(0), q.stride(0), s.stride(0),
                               BLOCK=block, num_warps=max(1, min(16, block // 256)))
    return q, s
