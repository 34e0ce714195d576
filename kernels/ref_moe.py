"""Torch reference of the fused mixture-of-experts MLP (kernels/triton_moe.py's contract).

Each token's hidden row goes through the experts its router chose; expert e computes
down_e(silu(gate_e x) * up_e x), and the outputs are summed weighted by the router's
weights. Experts outside this rank's range [expert_start, expert_start + E_local) add
nothing: under tensor parallelism the all-reduce that follows adds the other ranks' part.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from kernels.ref_fp8 import fp8_weight_only_ref


def fused_moe_ref(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                  topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                  expert_start: int = 0, config: dict[str, Any] | None = None,
                  w13_scale: torch.Tensor | None = None,
                  w2_scale: torch.Tensor | None = None) -> torch.Tensor:
    """x: [T, H]; w13: [E_local, 2I, H] = [gate | up] rows; w2: [E_local, H, I];
    topk_weights: [T, k] float32; topk_ids: [T, k] int (global expert ids).
    config: the Triton kernel's tile sizes, unused here. Returns [T, H] in x's dtype.
    The projections run in x's dtype as HF's experts do; the weighted sum over the top-k
    is kept in float32 and rounded once.
    FP8 experts (w13, w2 float8_e4m3fn with float32 scales [E_local, N, G], the per-row
    form of kernels/ref_fp8): each projection is ref_fp8's weight-only product, the
    float32 product of x and the dequantized weight rounded to x's dtype."""
    t, h = x.shape
    e_local, two_i, _ = w13.shape
    fp8 = w13_scale is not None and w2_scale is not None
    if (w13_scale is None) != (w2_scale is None):
        raise ValueError("w13_scale, w2_scale: FP8 experts need both")
    out = torch.zeros(t, h, dtype=torch.float32, device=x.device)  # [T, H]
    local = topk_ids.long() - expert_start  # [T, k]; outside [0, E_local): another rank's
    for e in range(e_local):
        # data-dependent shapes: fine for the CPU reference, which is never graph-captured
        tok, slot = torch.nonzero(local == e, as_tuple=True)  # [n], [n]
        if tok.numel() == 0:
            continue
        if fp8:
            assert w13_scale is not None and w2_scale is not None
            gate, up = fp8_weight_only_ref(x[tok], w13[e], w13_scale[e]).split(two_i // 2,
                                                                               dim=-1)
            y = fp8_weight_only_ref(F.silu(gate) * up, w2[e], w2_scale[e])
        else:
            gate, up = F.linear(x[tok], w13[e]).split(two_i // 2, dim=-1)  # [n, I] each
            y = F.linear(F.silu(gate) * up, w2[e])  # [n, H]
        out.index_add_(0, tok, y.float() * topk_weights[tok, slot].float().unsqueeze(-1))
    return out.to(x.dtype)


def moe_route_ref(logits: torch.Tensor, top_k: int, scoring_func: str, renormalize: bool,
                  routed_scaling_factor: float = 1.0,
                  e_score_correction_bias: torch.Tensor | None = None,
                  round_dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k routing without expert groups: logits [T, E] -> (weights [T, k] float32,
    ids [T, k] int64). Scores are softmax or sigmoid of the float32 logits; the bias (if
    any) is added for the choice only; the weights are the chosen experts' scores,
    renormalized to sum 1 (sigmoid: over sum + 1e-20, as DeepSeek-V3), times the scaling
    factor, then (round_dtype) rounded to the model's dtype as Qwen3-MoE does."""
    if scoring_func == "softmax":
        scores = logits.float().softmax(dim=-1)  # [T, E]
    elif scoring_func == "sigmoid":
        scores = logits.float().sigmoid()
    else:
        raise ValueError(f"scoring_func: must be 'softmax' or 'sigmoid', got {scoring_func!r}")
    choice = scores
    if e_score_correction_bias is not None:
        choice = scores + e_score_correction_bias.float().unsqueeze(0)
    ids = choice.topk(top_k, dim=-1, sorted=False)[1]  # [T, k]
    weights = scores.gather(1, ids)  # [T, k]
    if renormalize:
        eps = 1e-20 if scoring_func == "sigmoid" else 0.0
        weights = weights / (weights.sum(dim=-1, keepdim=True) + eps)
    if routed_scaling_factor != 1.0:
        weights = weights * routed_scaling_factor
    if round_dtype is not None and round_dtype != torch.float32:
        weights = weights.to(round_dtype).float()
    return weights, ids
