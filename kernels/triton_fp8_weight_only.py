"""Triton weight-only FP8 linear for few rows (decode): y = x @ (w * scale)^T with the FP8
weight converted to x's dtype in registers, so the step reads one byte per weight.

Reference: kernels/ref_fp8.fp8_weight_only_ref (same signature). At one to a few rows a
projection is bound by the weight's bytes; the grid covers N in BLOCK_N columns and, when
that leaves SMs idle, K in `splits` ranges whose float32 partial sums the reader adds
(engine/models/split_k.py) or, for a caller that wants [M, N], one sum here.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from kernels.triton_common import check, check_float

BLOCK_N = 64
BLOCK_K = 128
MAX_BLOCK_M = 64
# Programs per SM below which K is split (the weight stream needs every SM reading).
PROGRAMS_PER_SM = 2


@triton.jit
def _wo_kernel(x_ptr, w_ptr, s_ptr, out_ptr, M, N, K, s_xm, s_wn, s_sn, s_os, s_om,
               k_per_split, GROUP_K: tl.constexpr, ONE_GROUP: tl.constexpr,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_s = tl.program_id(1)
    pid_m = tl.program_id(2)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    m_ok = rm < M
    n_ok = rn < N
    k0 = pid_s * k_per_split
    k_end = tl.minimum(k0 + k_per_split, K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kk in range(k0, k_end, BLOCK_K):
        ks = kk + rk
        k_ok = ks < k_end
        x = tl.load(x_ptr + rm[:, None].to(tl.int64) * s_xm + ks[None, :],
                    mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_ptr + rn[:, None].to(tl.int64) * s_wn + ks[None, :],
                    mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        d = tl.dot(x, tl.trans(w.to(x.dtype)))
        if ONE_GROUP:
            acc += d
        else:
            sc = tl.load(s_ptr + rn * s_sn + kk // GROUP_K, mask=n_ok, other=0.0)
            acc += d * sc[None, :]
    if ONE_GROUP:
        sc = tl.load(s_ptr + rn * s_sn, mask=n_ok, other=0.0)
        acc = acc * sc[None, :]
    ptrs = out_ptr + pid_s * s_os + rm[:, None].to(tl.int64) * s_om + rn[None, :]
    tl.store(ptrs, acc.to(out_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


@functools.cache
def _sm_count(index: int) -> int:
    return int(torch.cuda.get_device_properties(index).multi_processor_count)


def choose_splits(m: int, n: int, k: int, groups: int, sms: int) -> int:
    """K ranges for [m, k] x [n, k] on `sms` SMs: doubled while the grid is under
    PROGRAMS_PER_SM per SM and each range keeps >= 4 K tiles (and, for block scales,
    whole scale groups)."""
    progs = triton.cdiv(n, BLOCK_N) * triton.cdiv(m, _block_m(m))
    gk = k // groups

    def fits(s: int) -> bool:
        c = k // s
        return k % s == 0 and c >= 4 * BLOCK_K and (groups == 1 or c % gk == 0)

    s = 1
    while progs * s < PROGRAMS_PER_SM * sms and fits(2 * s):
        s *= 2
    return s


def auto_splits(x: torch.Tensor, n: int, groups: int) -> int:
    """choose_splits for x on its device (1 off CUDA)."""
    if not x.is_cuda:
        return 1
    return choose_splits(x.shape[0], n, x.shape[1], groups, _sm_count(x.device.index or 0))


def _block_m(m: int) -> int:
    return min(MAX_BLOCK_M, max(16, triton.next_power_of_2(m)))


def fp8_weight_only(x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor,
                    splits: int = 1) -> torch.Tensor:
    """x [M, K], w [N, K] float8_e4m3fn, w_scale [N, G] float32 -> [M, N] in x's dtype
    (splits == 1) or [splits, M, N] float32 partial sums over K / splits columns each."""
    check(x.dim() == 2 and w.dim() == 2 and x.shape[1] == w.shape[1],
          "x [M, K] and w [N, K] must share K")
    check_float("x", x)
    check(w.dtype == torch.float8_e4m3fn, f"w: expected float8_e4m3fn, got {w.dtype}")
    m, k = x.shape
    n = w.shape[0]
    g = w_scale.shape[1]
    check(w_scale.shape[0] == n and k % g == 0, "w_scale: expected [N, G] with G dividing K")
    check(x.stride(1) == 1 and w.stride(1) == 1 and w_scale.stride(1) == 1,
          "x, w, w_scale: rows must be contiguous")
    gk = k // g
    block_k = BLOCK_K if g == 1 else min(BLOCK_K, gk)
    check(g == 1 or gk % block_k == 0, f"scale groups of {gk} columns: not a multiple of "
          f"{block_k}")
    check(splits >= 1 and k % splits == 0, f"splits: {splits} does not divide K={k}")
    kps = k // splits
    check(g == 1 or kps % gk == 0, f"splits: {splits} cuts a scale group of {gk} columns")
    if splits == 1:
        out = torch.empty(1, m, n, dtype=x.dtype, device=x.device)
    else:
        out = torch.empty(splits, m, n, dtype=torch.float32, device=x.device)
    if m == 0:
        return out[0] if splits == 1 else out
    bm = _block_m(m)
    grid = (triton.cdiv(n, BLOCK_N), splits, triton.cdiv(m, bm))
    _wo_kernel[grid](x, w, w_scale, out, m, n, k, x.stride(0), w.stride(0), w_scale.stride(0),
                     out.stride(0), out.stride(1), kps, GROUP_K=gk, ONE_GROUP=g == 1,
                     BLOCK_M=bm, BLOCK_N=BLOCK_N, BLOCK_K=block_k, num_warps=4, num_stages=4)
    return out[0] if splits == 1 else out
