"""Writes an allowed-token bitmask (structured output, engine/grammar/masks.py) into logits:
disallowed tokens get -inf. Plain torch, one code path on CPU and GPU (a few elementwise
kernels over [S, V]): the full sampler's; the simple sampler applies the mask in its own
pass (kernels/triton_sample.py)."""

from __future__ import annotations

import torch


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """logits [S, V] float, bitmask [S, ceil(V / 32)] int32 -> masked logits [S, V]."""
    s, v = logits.shape
    shifts = torch.arange(32, device=bitmask.device, dtype=torch.int32)
    allowed = ((bitmask.unsqueeze(-1) >> shifts) & 1).view(s, -1)[:, :v].bool()
    return logits.masked_fill(~allowed, float("-inf"))
