"""Torch reference of the fused gated activation: silu(gate) * up over [T, 2I] rows."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    """x: [T, 2I] = [gate | up] -> [T, I], in x's dtype as HF's MLP computes it (the Triton
    kernel works in float32 and rounds once, so low precision differs by a rounding)."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up
