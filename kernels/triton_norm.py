"""Triton RMSNorm (with fused residual add) and rotate-half RoPE (see ref_norm.py).

Both round exactly where the references round, so low-precision outputs match bit for
bit up to float32 summation order.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.pdl import follow, pdl_for
from kernels.triton_common import check, check_device, check_float, check_int, check_shape

# Columns of a row per warp (at most 16 warps): one program holds a whole row, which at one
# to a few rows (decode) is the whole kernel on one SM each. On the H200 with PDL, an 8B
# FP8 decode step at batch 1 took 2.777 ms at 512 (8 warps for 4096), 2.696 at 256 and
# 2.709 at 1024 (bench/fp8_bench.py --sections pdl --variants, bench/RESULTS.md).
COLS_PER_WARP = 256


def norm_warps(block_h: int) -> int:
    """Warps of a program that holds a BLOCK_H-wide row: _rms_norm_kernel's, and
    kernels/triton_router_route.py's prenorm launch's. The same count gives the row the
    same register layout, so the sum of squares adds in the same order on a GPU: the
    same rstd bits (the interpreter sums in one order whatever the warps)."""
    return min(16, max(1, block_h // COLS_PER_WARP))


@triton.jit
def add_residual(x, r):
    """x + r rounded to x's dtype, as the reference's x + residual: the new residual, and
    the row the norm reads."""
    return (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)


@triton.jit
def load_row(x_ptr, offs, mask, s_part, PARTS: tl.constexpr, DTYPE: tl.constexpr):
    """A row (zero past the mask): x's own at offs, or (PARTS > 0) the sum of a split-K
    projection's PARTS float32 partials s_part apart, rounded to DTYPE as the projection's
    own output would be: this replaces the GEMM's separate reduce kernel. _rms_norm_kernel's
    and kernels/triton_router_route.py's prenorm's (one copy, the same bits)."""
    x = tl.load(x_ptr + offs, mask=mask, other=0.0)
    if PARTS > 0:
        xs = x.to(tl.float32)  # 0 + the first partial, exactly, as a zero-started sum
        for p in tl.static_range(1, PARTS):
            xs += tl.load(x_ptr + p * s_part + offs, mask=mask, other=0.0)
        x = xs.to(DTYPE)
    return x


@triton.jit
def rms_norm_row(x, w_ptr, cols, mask, H, eps):
    """weight * round(x * rstd) in float32 (the caller rounds it to its output), for one
    row x [BLOCK_H] in its dtype, zero past H. With add_residual, the arithmetic of
    _rms_norm_kernel and of kernels/triton_router_route.py's prenorm (Triton inlines both
    into each): one copy, so the two give the same bits."""
    xf = x.to(tl.float32)  # [BLOCK_H]
    rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=0) / H + eps)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    normed = (xf * rstd).to(x.dtype).to(tl.float32)
    return normed * w


@triton.jit
def _rms_norm_kernel(
    x_ptr, res_ptr, w_ptr, out_ptr, new_res_ptr,
    scale_ptr,  # QUANT: each row's float32 scale
    s_x, s_r, s_o, s_nr,  # row strides; rows are contiguous
    s_part,  # PARTS > 0: stride between x's float32 partial sums
    H, eps,
    HAS_RES: tl.constexpr, BLOCK_H: tl.constexpr, PARTS: tl.constexpr, PDL: tl.constexpr,
    QUANT: tl.constexpr,
):
    if PDL:  # every input may be the kernel before's output (kernels/pdl.py)
        follow()
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_H)
    mask = cols < H
    x = load_row(x_ptr, row * s_x + cols, mask, s_part, PARTS, res_ptr.dtype.element_ty)
    if HAS_RES:
        x = add_residual(x, tl.load(res_ptr + row * s_r + cols, mask=mask, other=0.0))
        tl.store(new_res_ptr + row * s_nr + cols, x, mask=mask)
    y = rms_norm_row(x, w_ptr, cols, mask, H, eps)  # [BLOCK_H] float32
    if QUANT:
        # The row as the unfused kernel would store it (rounded to x's dtype), then exactly
        # kernels/triton_fp8_gemm.quant_rows' arithmetic on it: the same FP8 bytes and scale.
        y = y.to(x.dtype).to(tl.float32)
        scale = tl.maximum(tl.max(tl.abs(y), axis=0) / 448.0, 1e-12)
        q = tl.minimum(tl.maximum(y / scale, -448.0), 448.0)
        tl.store(out_ptr + row * s_o + cols, q.to(out_ptr.dtype.element_ty), mask=mask)
        tl.store(scale_ptr + row, scale)
    else:
        tl.store(out_ptr + row * s_o + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm(
    x: torch.Tensor,  # [T, H], or [S, T, H] float32 partial sums (residual then required)
    weight: torch.Tensor,  # [H]
    eps: float,
    residual: torch.Tensor | None = None,  # [T, H]: added to x first when given
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (normed, new_residual); new_residual is x (+ residual). Inputs are not modified.
    Partial sums are summed in float32 and rounded to the residual's dtype first."""
    out, new_res, _ = _rms_norm(x, weight, eps, residual, quant=False)
    return out, new_res


def rms_norm_quant(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """rms_norm whose output is quantized per row for an FP8 x FP8 projection, in the same
    pass: (q [T, H] float8_e4m3fn, scale [T, 1] float32, new_residual). q and scale are what
    kernels/triton_fp8_gemm.quant_rows(rms_norm(...)[0], 1) would give
    (kernels/ref_norm.rms_norm_quant_ref)."""
    q, new_res, scale = _rms_norm(x, weight, eps, residual, quant=True)
    return q, scale, new_res


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
              residual: torch.Tensor | None, quant: bool
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    parts, x_parts = 0, x
    if x.dim() == 3:
        check(residual is not None, "x: partial sums [S, T, H] need a residual")
        check(x.dtype == torch.float32, "x: partial sums must be float32")
        check(x.stride(2) == 1, "x: rows must be contiguous")
        parts, x_parts = x.shape[0], x
        x = x[0]
    check(x.dim() == 2, "x: expected [T, H]")
    num_tokens, hidden = x.shape
    check_shape("weight", weight, (hidden,))
    check_float("x", x)
    check_float("weight", weight)
    check(x.stride(1) == 1, "x: rows must be contiguous")
    if residual is not None:
        check_shape("residual", residual, x.shape)
        check(parts > 0 or residual.dtype == x.dtype, "residual: dtype must match x")
        check(residual.stride(1) == 1, "residual: rows must be contiguous")
        check_device(x, weight, residual)
    check_device(x, weight)
    like = residual if parts and residual is not None else x
    new_res = (x if residual is None
               else torch.empty_like(like, memory_format=torch.contiguous_format))
    if quant:
        out = torch.empty(like.shape, dtype=torch.float8_e4m3fn, device=like.device)
    else:
        out = torch.empty_like(like, memory_format=torch.contiguous_format)
    scale = torch.empty(num_tokens if quant else 0, 1, dtype=torch.float32, device=x.device)
    # without QUANT the kernel never touches scale_ptr: any valid pointer will do
    if num_tokens == 0:
        return out, new_res, scale
    res = residual if residual is not None else x  # unused pointer when HAS_RES is False
    block_h = triton.next_power_of_2(hidden)
    pdl = pdl_for(x)
    _rms_norm_kernel[(num_tokens,)](
        x, res, weight, out, new_res, scale if quant else weight,
        x.stride(0), res.stride(0), out.stride(0), new_res.stride(0),
        x_parts.stride(0) if parts else 0,
        hidden, eps,
        HAS_RES=residual is not None, BLOCK_H=block_h, PARTS=parts, PDL=pdl,
        QUANT=quant,
        num_warps=norm_warps(block_h), launch_pdl=pdl,
    )
    return out, new_res, scale


@triton.jit
def _rope_rows(x_ptr, o_ptr, s_xt, s_xh, s_ot, s_oh, t, cos, sin,
               H: tl.constexpr, HALF: tl.constexpr, BLOCK_H: tl.constexpr):
    h = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, HALF)[None, :]
    mask = h < H
    src = x_ptr + t * s_xt + h * s_xh + d  # [BLOCK_H, HALF]: first halves
    x1 = tl.load(src, mask=mask).to(tl.float32)
    x2 = tl.load(src + HALF, mask=mask).to(tl.float32)
    dst = o_ptr + t * s_ot + h * s_oh + d
    ty = o_ptr.dtype.element_ty
    tl.store(dst, (x1 * cos - x2 * sin).to(ty), mask=mask)
    tl.store(dst + HALF, (x2 * cos + x1 * sin).to(ty), mask=mask)


@triton.jit
def _rope_kernel(
    q_ptr, k_ptr, qo_ptr, ko_ptr, pos_ptr, cs_ptr,
    s_qt, s_qh, s_kt, s_kh, s_qot, s_qoh, s_kot, s_koh, s_cs,
    HQ: tl.constexpr, HKV: tl.constexpr, HALF: tl.constexpr,
    BLOCK_HQ: tl.constexpr, BLOCK_HKV: tl.constexpr,
):
    # One program per token: cos/sin are loaded once and shared by all q and k heads.
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    d = tl.arange(0, HALF)[None, :]
    cos = tl.load(cs_ptr + pos * s_cs + d)  # [1, HALF] float32
    sin = tl.load(cs_ptr + pos * s_cs + HALF + d)
    _rope_rows(q_ptr, qo_ptr, s_qt, s_qh, s_qot, s_qoh, t, cos, sin, HQ, HALF, BLOCK_HQ)
    _rope_rows(k_ptr, ko_ptr, s_kt, s_kh, s_kot, s_koh, t, cos, sin, HKV, HALF, BLOCK_HKV)


def rope(
    q: torch.Tensor,  # [T, Hq, D]
    k: torch.Tensor,  # [T, Hkv, D]
    positions: torch.Tensor,  # [T] int32/int64
    cos_sin: torch.Tensor,  # [max_pos, D] float32: cos in [:, :D/2], sin in [:, D/2:]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate-half (NeoX / HF Llama) rotary embedding; returns new tensors."""
    check(q.dim() == 3 and k.dim() == 3, "q, k: expected [T, H, D]")
    num_tokens, hq, d = q.shape
    hkv = k.shape[1]
    check_shape("k", k, (num_tokens, hkv, d))
    check_shape("positions", positions, (num_tokens,))
    check(cos_sin.dim() == 2 and cos_sin.shape[1] == d, "cos_sin: expected [max_pos, D]")
    check(cos_sin.dtype == torch.float32 and cos_sin.stride(1) == 1,
          "cos_sin: expected contiguous rows of float32")
    check(d % 2 == 0 and (d & (d - 1)) == 0, f"head_dim {d} must be a power of two")
    check(q.stride(2) == 1 and k.stride(2) == 1, "q, k: head_dim must be contiguous")
    check_float("q", q)
    check_float("k", k)
    check_int("positions", positions)
    check_device(q, k, positions, cos_sin)
    q_out = torch.empty_like(q, memory_format=torch.contiguous_format)
    k_out = torch.empty_like(k, memory_format=torch.contiguous_format)
    if num_tokens == 0:
        return q_out, k_out
    _rope_kernel[(num_tokens,)](
        q, k, q_out, k_out, positions, cos_sin,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1),
        q_out.stride(0), q_out.stride(1), k_out.stride(0), k_out.stride(1), cos_sin.stride(0),
        HQ=hq, HKV=hkv, HALF=d // 2,
        BLOCK_HQ=triton.next_power_of_2(hq), BLOCK_HKV=triton.next_power_of_2(hkv),
        num_warps=4,
    )
    return q_out, k_out
