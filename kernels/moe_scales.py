"""The check of an FP8 expert stack's scales, and the one-token kernels' K tile under them,
shared by the fused MoE kernels' launchers (kernels/triton_moe.py, triton_moe_down_sum.py,
triton_moe_gate_up_gemv.py): the last two are imported by the first, so these live apart
from all three."""

from __future__ import annotations

import torch

from kernels.triton_common import check, check_device


def scale_groups(name: str, scale: torch.Tensor, w: torch.Tensor) -> int:
    """An FP8 stack w [E, N, K]'s scales [E, N, G] (float32, rows of G contiguous): G, the
    scale groups along K (1: one scale per output channel). ValueError naming `name`."""
    e, n, kk = w.shape
    check(scale.dim() == 3 and tuple(scale.shape[:2]) == (e, n),
          f"{name}: expected [{e}, {n}, G], got {tuple(scale.shape)}")
    check(scale.dtype == torch.float32, f"{name}: expected float32, got {scale.dtype}")
    check(scale.stride(2) == 1, f"{name}: rows must be contiguous")
    check_device(w, scale)
    g = scale.shape[2]
    gk = kk // g if g else 0
    # grouped scales: a K tile (a power of two >= 16) must lie inside one group
    check(g >= 1 and kk % g == 0 and (g == 1 or (gk >= 16 and gk & (gk - 1) == 0)),
          f"{name}: {g} scale groups do not cut K={kk} into power-of-two groups >= 16")
    return int(g)


def weight_groups(name: str, w: torch.Tensor, scale: torch.Tensor | None,
                  dtype: torch.dtype, like: str) -> int:
    """The scale groups along K of a dot-free kernel's expert stack `name`: 1 for weights
    in the activations' dtype (named `like`), else float8_e4m3fn weights with their scales
    checked (scale_groups)."""
    if scale is None:
        check(w.dtype == dtype, f"{name}: expected {like}'s dtype {dtype}, got {w.dtype}")
        return 1
    check(w.dtype == torch.float8_e4m3fn,
          f"{name}: {name}_scale given, expected float8_e4m3fn, got {w.dtype}")
    return scale_groups(f"{name}_scale", scale, w)


def k_tile(block_k: int, k: int, groups: int) -> int:
    """A dot-free kernel's K tile for rows of k: a power of two no wider than block_k or
    k, so the last tile can move back inside the row (the kernels' EVEN_K comments); with
    block scales, inside one group, so k is whole tiles."""
    bk = min(block_k, 1 << (k.bit_length() - 1)) if k else block_k
    return min(bk, k // groups) if groups > 1 else bk
