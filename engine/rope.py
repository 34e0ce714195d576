"""Rotary-embedding tables, including Llama 3's frequency scaling and YaRN (DeepSeek)."""

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
    if kind == "yarn":
        return _yarn_inv_frequencies(inv, head_dim, theta, scaling)
    raise ValueError(f"rope_scaling: type {kind!r} is not supported (linear, llama3, yarn)")


def _yarn_inv_frequencies(inv: torch.Tensor, head_dim: int, theta: float,
                          scaling: dict[str, Any]) -> torch.Tensor:
    """YaRN: frequencies that turn fewer than beta_slow times over the original context are
    slowed by `factor`, those turning more than beta_fast times kept, a linear ramp between
    (transformers' _compute_yarn_parameters, so the angles match it)."""
    factor = float(scaling["factor"])
    orig = float(scaling["original_max_position_embeddings"])
    fast = float(scaling.get("beta_fast") or 32)
    slow = float(scaling.get("beta_slow") or 1)

    def dim_of(rotations: float) -> float:  # the dimension turning `rotations` times
        return head_dim * math.log(orig / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = dim_of(fast), dim_of(slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # a zero-width ramp would divide by zero
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp  # 1: extrapolate (keep the frequency), 0: interpolate (divide it)
    pos = theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim)
    return 1.0 / (factor * pos) * (1 - keep) + inv * keep


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def rope_attention_factor(scaling: dict[str, Any] | None) -> float:
    """What YaRN multiplies cos and sin by (so q.k scales by its square); 1 otherwise."""
    if not scaling or scaling.get("rope_type", scaling.get("type")) != "yarn":
        return 1.0
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    factor = float(scaling["factor"])
    m, m_all = scaling.get("mscale"), scaling.get("mscale_all_dim")
    if m and m_all:
        return yarn_mscale(factor, float(m)) / yarn_mscale(factor, float(m_all))
    return yarn_mscale(factor)


def softmax_mscale(scaling: dict[str, Any] | None) -> float:
    """DeepSeek's correction of the softmax scale under YaRN: mscale(factor, mscale_all_dim)
    squared, since the cos/sin factor above divides it out of the rotated dims only."""
    if not scaling or scaling.get("rope_type", scaling.get("type")) == "default":
        return 1.0
    m_all = scaling.get("mscale_all_dim") or 0
    if not m_all:
        return 1.0
    m = yarn_mscale(float(scaling["factor"]), float(m_all))
    return m * m


def cos_sin_table(head_dim: int, max_pos: int, theta: float,
                  scaling: dict[str, Any] | None) -> torch.Tensor:
    """[max_pos, head_dim] float32: cos of each frequency in the first half, sin in the second."""
    inv = inv_frequencies(head_dim, theta, scaling)
    angles = torch.arange(max_pos, dtype=torch.float32)[:, None] * inv.float()[None, :]
    table = torch.cat((angles.cos(), angles.sin()), dim=-1)
    att = rope_attention_factor(scaling)
    return table if att == 1.0 else table * att
