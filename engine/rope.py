"""Rotary-embedding tables, including Llama 3's frequency scaling."""

from __future__ import annotations

import math
from typing import Any

import torch


def inv_frequencies(head_dim: int, theta: float, scaling: dict[str, Any] | None) -> torch.Tensor:
    # float32 throughout, as HF computes it, so positions map to bit-identical angles.
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if not scaling:
        return inv
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind == "linear":
        return inv / float(scaling["factor"])
    if kind == "llama3":
        factor = float(scaling["factor"])
        low = float(scaling.get("low_freq_factor", 1.0))
        high = float(scaling.get("high_freq_factor", 4.0))
        orig = float(scaling["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv
        # Long wavelengths are slowed by `factor`, short ones kept, the band between blended.
        smooth = (orig / wavelen - low) / (high - low)
        blended = (1 - smooth) * inv / factor + smooth * inv
        out = torch.where(wavelen > orig / low, inv / factor, inv)
        mid = (wavelen <= orig / low) & (wavelen >= orig / high)
        return torch.where(mid, blended, out)
    raise ValueError(f"rope_scaling: type {kind!r} is not supported (linear, llama3)")


def cos_sin_table(head_dim: int, max_pos: int, theta: float,
                  scaling: dict[str, Any] | None) -> torch.Tensor:
    """[max_pos, head_dim] float32: cos of each frequency in the first half, sin in the second."""
    inv = inv_frequencies(head_dim, theta, scaling)
    angles = torch.arange(max_pos, dtype=torch.float32)[:, None] * inv.float()[None, :]
    return torch.cat((angles.cos(), angles.sin()), dim=-1)
