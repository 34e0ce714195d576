"""The check of an FP8 expert stack's scales, shared by the fused MoE kernels' launchers
(kernels/triton_moe.py, triton_moe_down_sum.py, triton_moe_gate_up_gemv.py): the last two
are imported by the first, so the check lives apart from all three."""

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
