"""Triton fused gated activation: silu(gate) * up in one pass (see ref_act.py).

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
