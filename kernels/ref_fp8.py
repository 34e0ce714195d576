"""Torch references of the FP8 linear kernels, and the activation quantization both use.

Weights are float8_e4m3fn [N, K] with float32 scales [N, G] that multiply them: G = 1 for
per-channel (and per-tensor, repeated per row) scales, G = K / gk for block-wise ones (each
row carries its block's scale for each group of gk = K / G columns). Activations quantized
by the same rule carry scales [M, G].
"""

from __future__ import annotations

import torch

FP8 = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8).max)  # 448
# Scales are kept at or above this so an all-zero row quantizes to zeros, not NaN.
MIN_SCALE = 1e-12


def quant_rows(x: torch.Tensor, groups: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic quantization of x [M, K] per row and group of K / groups columns:
    (xq float8_e4m3fn [M, K], scale float32 [M, groups]) with x ~= xq * scale."""
    m, k = x.shape
    xg = x.float().view(m, groups, k // groups)
    scale = (xg.abs().amax(dim=-1) / FP8_MAX).clamp_min(MIN_SCALE)  # [M, G]
    xq = (xg / scale.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).to(FP8).view(m, k)
    return xq, scale


def quant_static(x: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantization by a fixed per-tensor scale [1] (a checkpoint's ``input_scale``):
    (xq [M, K], scale [M, 1])."""
    xq = (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return xq, scale.float().expand(x.shape[0], 1)


def dequant(w: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """w [N, K] fp8, scale [N, G] -> float32 [N, K]."""
    n, k = w.shape
    g = scale.shape[1]
    return (w.float().view(n, g, k // g) * scale.float().unsqueeze(-1)).view(n, k)


def fp8_weight_only_ref(x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor,
                        splits: int = 1) -> torch.Tensor:
    """x [M, K] (the model's dtype) times the dequantized w [N, K]^T. splits == 1: [M, N]
    in x's dtype; else [splits, M, N] float32 partial sums over equal K ranges (summed by
    the kernel that reads them, as engine/models/split_k.py's partials)."""
    wd = dequant(w, w_scale)
    xf = x.float()
    if splits == 1:
        return (xf @ wd.t()).to(x.dtype)
    c = x.shape[1] // splits
    return torch.stack([xf[:, i * c:(i + 1) * c] @ wd[:, i * c:(i + 1) * c].t()
                        for i in range(splits)])


def fp8_gemm_ref(xq: torch.Tensor, x_scale: torch.Tensor, w: torch.Tensor,
                 w_scale: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """FP8 x FP8: xq [M, K] with x_scale [M, G], w [N, K] with w_scale [N, G] (G == 1:
    per-row and per-channel scales; G > 1: both in groups of K / G) -> [M, N] out_dtype."""
    return (dequant(xq, x_scale) @ dequant(w, w_scale).t()).to(out_dtype)


def quantize_weight(w: torch.Tensor, strategy: str,
                    block: tuple[int, int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """A float weight [N, K] as (fp8 [N, K], scale) in the checkpoint's own scale shape:
    "tensor" [1], "channel" [N, 1], "block" [ceil(N / bn), ceil(K / bk)]."""
    wf = w.float()
    if strategy == "tensor":
        scale = (wf.abs().amax() / FP8_MAX).clamp_min(MIN_SCALE).reshape(1)
        return (wf / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale
    if strategy == "channel":
        scale = (wf.abs().amax(dim=1, keepdim=True) / FP8_MAX).clamp_min(MIN_SCALE)
        return (wf / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale
    if strategy != "block" or block is None:
        raise ValueError(f"strategy: expected 'tensor', 'channel' or 'block' with a block "
                         f"shape, got {strategy!r}")
    bn, bk = block
    n, k = wf.shape
    pn, pk = -(-n // bn) * bn, -(-k // bk) * bk
    padded = torch.zeros(pn, pk, dtype=torch.float32, device=w.device)
    padded[:n, :k] = wf
    tiles = padded.view(pn // bn, bn, pk // bk, bk)
    scale = (tiles.abs().amax(dim=(1, 3)) / FP8_MAX).clamp_min(MIN_SCALE)  # [Nb, Kb]
    q = (tiles / scale[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q.view(pn, pk)[:n, :k].contiguous(), scale


def quantize_stack(w: torch.Tensor, block: tuple[int, int] | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """Stacked expert weights [E, N, K] as (fp8 [E, N, K], scale float32 [E, N, G]) in the
    per-row form the fused MoE kernel reads: block None, one scale per output channel
    (G = 1); block (bn, bk), one per bn x bk tile, each row holding its tile's scale for
    each of G = ceil(K / bk) column groups."""
    e, n, k = w.shape
    g = 1 if block is None else -(-k // block[1])
    q = torch.empty(e, n, k, dtype=FP8, device=w.device)
    scale = torch.empty(e, n, g, dtype=torch.float32, device=w.device)
    for j in range(e):  # one expert at a time: the float32 copy is one expert's
        if block is None:
            q[j], scale[j] = quantize_weight(w[j], "channel")
        else:
            q[j], s = quantize_weight(w[j], "block", block)
            scale[j] = s.repeat_interleave(block[0], dim=0)[:n]
    return q, scale


def dequant_stack(w: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """fp8 [E, N, K] with scales [E, N, G] -> float32 [E, N, K]."""
    return torch.stack([dequant(w[j], scale[j]) for j in range(w.shape[0])])
