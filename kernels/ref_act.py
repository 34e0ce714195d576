"""Torch reference of the fused gated activation: silu(gate) * up over [T, 2I] rows, and
of the same quantized per row for an FP8 x FP8 projection."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.ref_fp8 import quant_rows


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    """x: [T, 2I] = [gate | up] -> [T, I], in x's dtype as HF's MLP computes it (the Triton
    kernel works in float32 and rounds once, so low precision differs by a rounding)."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def silu_and_mul_quant_ref(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x: [T, 2I] -> (q [T, I] float8_e4m3fn, scale [T, 1] float32): silu_and_mul_ref's
    output quantized per row (kernels/ref_fp8.quant_rows)."""
    return quant_rows(silu_and_mul_ref(x), 1)
