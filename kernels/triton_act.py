"""Triton fused gated activation: silu(gate) * up in one pass (see ref_act.py), and the same
with its output quantized per row for an FP8 x FP8 down_proj (silu_and_mul_quant).

Unfused, the MLP's activation is three kernels per layer (silu, multiply, and the copy the
split's views force); a decode step of a 32-layer model spends ~100 launches on it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.pdl import follow, pdl_for
from kernels.triton_common import check, check_float

BLOCK = 1024


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, s_x, s_o, inter, BLOCK: tl.constexpr,
                         PDL: tl.constexpr):
    if PDL:  # x is the kernel before's output (kernels/pdl.py)
        follow()
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    g = tl.load(x_ptr + row * s_x + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(x_ptr + row * s_x + inter + cols, mask=mask, other=0.0).to(tl.float32)
    y = g / (1.0 + tl.exp(-g)) * u
    tl.store(out_ptr + row * s_o + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x: [T, 2I] = [gate | up] -> [T, I]."""
    check(x.dim() == 2 and x.shape[1] % 2 == 0, "x: expected [T, 2I]")
    check_float("x", x)
    check(x.stride(1) == 1, "x: rows must be contiguous")
    t, inter = x.shape[0], x.shape[1] // 2
    out = torch.empty(t, inter, dtype=x.dtype, device=x.device)
    if t == 0:
        return out
    pdl = pdl_for(x)
    _silu_and_mul_kernel[(t, triton.cdiv(inter, BLOCK))](
        x, out, x.stride(0), out.stride(0), inter, BLOCK=BLOCK, PDL=pdl, num_warps=4,
        launch_pdl=pdl)
    return out


# Columns per pass of the quantizing kernel: one program owns a row (its scale needs the
# row's largest value), reading it twice: once for the maximum, once to write (the second
# read mostly from L2: an 8B model's row of gate and up is 56 KiB).
QUANT_BLOCK = 2048


@triton.jit
def _silu_and_mul_quant_kernel(x_ptr, q_ptr, s_ptr, s_x, s_q, inter, BLOCK: tl.constexpr,
                               PDL: tl.constexpr):
    if PDL:  # x is the kernel before's output (kernels/pdl.py)
        follow()
    row = tl.program_id(0).to(tl.int64)
    src = x_ptr + row * s_x
    big = tl.zeros([BLOCK], tl.float32)
    for c0 in range(0, inter, BLOCK):
        cols = c0 + tl.arange(0, BLOCK)
        mask = cols < inter
        g = tl.load(src + cols, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(src + inter + cols, mask=mask, other=0.0).to(tl.float32)
        # rounded to x's dtype as silu_and_mul stores it: the bytes quant_rows would read
        y = (g / (1.0 + tl.exp(-g)) * u).to(x_ptr.dtype.element_ty).to(tl.float32)
        big = tl.maximum(big, tl.abs(y))
    scale = tl.maximum(tl.max(big, axis=0) / 448.0, 1e-12)
    for c0 in range(0, inter, BLOCK):
        cols = c0 + tl.arange(0, BLOCK)
        mask = cols < inter
        g = tl.load(src + cols, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(src + inter + cols, mask=mask, other=0.0).to(tl.float32)
        y = (g / (1.0 + tl.exp(-g)) * u).to(x_ptr.dtype.element_ty).to(tl.float32)
        q = tl.minimum(tl.maximum(y / scale, -448.0), 448.0)
        tl.store(q_ptr + row * s_q + cols, q.to(q_ptr.dtype.element_ty), mask=mask)
    tl.store(s_ptr + row, scale)


def silu_and_mul_quant(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x: [T, 2I] = [gate | up] -> (q [T, I] float8_e4m3fn, scale [T, 1] float32): what
    kernels/triton_fp8_gemm.quant_rows(silu_and_mul(x), 1) gives, in one kernel
    (kernels/ref_act.silu_and_mul_quant_ref)."""
    check(x.dim() == 2 and x.shape[1] % 2 == 0, "x: expected [T, 2I]")
    check_float("x", x)
    check(x.stride(1) == 1, "x: rows must be contiguous")
    t, inter = x.shape[0], x.shape[1] // 2
    q = torch.empty(t, inter, dtype=torch.float8_e4m3fn, device=x.device)
    scale = torch.empty(t, 1, dtype=torch.float32, device=x.device)
    if t == 0:
        return q, scale
    pdl = pdl_for(x)
    _silu_and_mul_quant_kernel[(t,)](
        x, q, scale, x.stride(0), q.stride(0), inter,
        BLOCK=min(QUANT_BLOCK, triton.next_power_of_2(inter)), PDL=pdl, num_warps=8,
        launch_pdl=pdl)
    return q, scale
