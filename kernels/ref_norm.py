"""Plain-torch references for RMSNorm (with fused residual add, and with its output
quantized per row for an FP8 x FP8 projection) and rotary embedding."""

from __future__ import annotations

import torch

from kernels.ref_fp8 import quant_rows


def rms_norm_ref(
    x: torch.Tensor,  # [T, H], or [S, T, H] float32 partial sums (residual then required)
    weight: torch.Tensor,  # [H]
    eps: float,
    residual: torch.Tensor | None = None,  # [T, H]: added to x first when given
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (normed, new_residual); new_residual is x (+ residual), the sum fed forward."""
    if x.dim() == 3:
        assert residual is not None, "x: partial sums [S, T, H] need a residual"
        x = x.sum(0).to(residual.dtype)
    if residual is not None:
        x = x + residual
    xf = x.float()
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (normed.to(x.dtype) * weight).to(x.dtype), x


def rms_norm_quant_ref(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q [T, H] float8_e4m3fn, scale [T, 1] float32, new_residual): rms_norm_ref's output
    quantized per row (kernels/ref_fp8.quant_rows)."""
    out, res = rms_norm_ref(x, weight, eps, residual)
    q, scale = quant_rows(out, 1)
    return q, scale, res


def rope_ref(
    q: torch.Tensor,  # [T, Hq, D]
    k: torch.Tensor,  # [T, Hkv, D]
    positions: torch.Tensor,  # [T] int64
    cos_sin: torch.Tensor,  # [max_pos, D] float32: cos in [:, :D/2], sin in [:, D/2:]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate-half (NeoX / HF Llama) rotary embedding; returns new tensors."""
    half = q.shape[-1] // 2
    cs = cos_sin[positions]  # [T, D]
    cos = cs[:, None, :half]
    sin = cs[:, None, half:]

    def rot(x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        x1, x2 = xf[..., :half], xf[..., half:]
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)

    return rot(q), rot(k)
