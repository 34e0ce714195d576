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
from kernels.ref_norm import rms_norm_ref


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


def router_logits_ref(x: torch.Tensor, w: torch.Tensor, out_dtype: torch.dtype
                      ) -> torch.Tensor:
    """The router's logits as HF computes them: a float32 router (DeepSeek) as a float32
    linear of the widened hidden state, any other in the model's dtype."""
    if out_dtype == torch.float32:
        return F.linear(x.float(), w.float())
    return F.linear(x, w).to(out_dtype)


def moe_route_ref(logits: torch.Tensor, top_k: int, scoring_func: str, renormalize: bool,
                  routed_scaling_factor: float = 1.0,
                  e_score_correction_bias: torch.Tensor | None = None,
                  round_dtype: torch.dtype | None = None,
                  num_shared: int = 0, n_group: int | None = None,
                  topk_group: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k routing: logits [T, E] -> (weights [T, k + S] float32, ids [T, k + S] int64).
    Scores are softmax or sigmoid of the float32 logits; the bias (if any) is added for the
    choice only; the weights are the chosen experts' scores, renormalized to sum 1
    (sigmoid: over sum + 1e-20, as DeepSeek-V3), times the scaling factor, then
    (round_dtype) rounded to the model's dtype as Qwen3-MoE does.
    Expert groups (n_group > 1): only experts of the best topk_group groups are eligible.
    softmax (DeepSeek-V2's group_limited_greedy): a group scores its best expert and the
    others' scores become 0; sigmoid (DeepSeek-V3's noaux_tc): a group scores the sum of
    its two best biased scores and the others are never picked.
    num_shared S: always-on experts stacked after the routed ones (ids E .. E + S - 1)
    follow the top-k in every row with weight 1 (no renormalization, no scaling)."""
    if scoring_func == "softmax":
        scores = logits.float().softmax(dim=-1)  # [T, E]
    elif scoring_func == "sigmoid":
        scores = logits.float().sigmoid()
    else:
        raise ValueError(f"scoring_func: must be 'softmax' or 'sigmoid', got {scoring_func!r}")
    choice = scores
    if e_score_correction_bias is not None:
        choice = scores + e_score_correction_bias.float().unsqueeze(0)
    if n_group is not None and topk_group is not None and n_group > 1:
        t, e = logits.shape
        grouped = choice.view(t, n_group, e // n_group)  # [T, G, E/G]
        if scoring_func == "sigmoid":
            group_scores = grouped.topk(min(2, e // n_group), dim=-1)[0].sum(dim=-1)  # [T, G]
        else:
            group_scores = grouped.max(dim=-1).values
        group_idx = group_scores.topk(topk_group, dim=-1, sorted=False)[1]  # [T, topk_group]
        keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, group_idx, True)
        keep = keep.unsqueeze(-1).expand(t, n_group, e // n_group).reshape(t, e)  # [T, E]
        # V2 zeroes the dropped softmax scores, V3 makes its biased choice scores -inf
        choice = choice.masked_fill(~keep, float("-inf") if scoring_func == "sigmoid" else 0.0)
    ids = choice.topk(top_k, dim=-1, sorted=False)[1]  # [T, k]
    weights = scores.gather(1, ids)  # [T, k]
    if renormalize:
        eps = 1e-20 if scoring_func == "sigmoid" else 0.0
        weights = weights / (weights.sum(dim=-1, keepdim=True) + eps)
    if routed_scaling_factor != 1.0:
        weights = weights * routed_scaling_factor
    if round_dtype is not None and round_dtype != torch.float32:
        weights = weights.to(round_dtype).float()
    if num_shared:
        return append_shared(weights, ids, logits.shape[1], num_shared)
    return weights, ids


def append_shared(weights: torch.Tensor, ids: torch.Tensor, first: int,
                  num_shared: int) -> tuple[torch.Tensor, torch.Tensor]:
    """weights, ids [T, k] -> [T, k + S]: every token also routed to experts first ..
    first + S - 1 (the shared experts stacked after the routed ones) with weight 1."""
    t = ids.shape[0]
    shared = torch.arange(first, first + num_shared, dtype=ids.dtype, device=ids.device)
    return (torch.cat([weights, weights.new_ones(t, num_shared)], dim=1),
            torch.cat([ids, shared.expand(t, num_shared)], dim=1))


def router_route_ref(x: torch.Tensor, w: torch.Tensor, out_dtype: torch.dtype, top_k: int,
                     scoring_func: str, renormalize: bool, routed_scaling_factor: float = 1.0,
                     e_score_correction_bias: torch.Tensor | None = None,
                     round_dtype: torch.dtype | None = None, num_shared: int = 0,
                     n_group: int | None = None,
                     topk_group: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """kernels/triton_router_route.router_route's contract: the router's logits (rounded to
    out_dtype), then the top-k routing of them; the arguments after out_dtype are
    moe_route_ref's."""
    return moe_route_ref(router_logits_ref(x, w, out_dtype), top_k, scoring_func, renormalize,
                         routed_scaling_factor, e_score_correction_bias, round_dtype,
                         num_shared, n_group, topk_group)


def down_sum_ref(act: torch.Tensor, w2: torch.Tensor, topk_ids: torch.Tensor,
                 topk_weights: torch.Tensor, out: torch.Tensor, expert_start: int = 0,
                 w2_scale: torch.Tensor | None = None, pdl: bool = False,
                 next_norm: tuple[torch.Tensor, float, torch.Tensor] | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor] | None:
    """kernels/triton_moe_down_sum.down_sum's contract: out[t] = the sum over slots j, in
    order, of topk_weights[t, j] times pair t * k + j's down projection (act's row through
    its expert's w2, rounded to act's dtype as HF's expert returns it), in float32 and
    rounded once; pairs of another rank's experts add nothing. pdl: the kernel's launch
    option, unused here. next_norm (weight, eps, residual): out receives the new residual
    (that sum + residual) and the return is (rms_norm of it, out), as the next layer's
    input_layernorm would give (kernels/ref_norm.rms_norm_ref)."""
    t, k = topk_ids.shape
    local = topk_ids.long() - expert_start  # [T, k]
    rows = act.view(t, k, act.shape[1])
    total = torch.zeros(t, w2.shape[1], dtype=torch.float32, device=act.device)
    for i in range(t):
        for j in range(k):
            e = int(local[i, j])
            if not 0 <= e < w2.shape[0]:
                continue
            a = rows[i, j][None]  # [1, I]
            y = (F.linear(a, w2[e]) if w2_scale is None
                 else fp8_weight_only_ref(a, w2[e], w2_scale[e]))  # [1, H], act's dtype
            total[i] += y[0].float() * topk_weights[i, j].float()
    out.copy_(total.to(out.dtype))
    if next_norm is None:
        return None
    weight, eps, residual = next_norm
    normed, new_residual = rms_norm_ref(out.clone(), weight, eps, residual)
    out.copy_(new_residual)
    return normed, out


def gate_up_gemv_ref(x: torch.Tensor, w13: torch.Tensor, act: torch.Tensor,
                     topk_ids: torch.Tensor, expert_start: int = 0,
                     w13_scale: torch.Tensor | None = None, pdl: bool = False) -> None:
    """kernels/triton_moe_gate_up_gemv.gate_up_gemv's contract: act[t * k + j] =
    silu(gate) * up for token t through its slot-j expert's w13 ([gate | up] rows), gate
    and up each rounded to x's dtype as the unfused linear returns them, the product
    rounded once; rows of another rank's experts are not written. pdl: unused here."""
    t, k = topk_ids.shape
    inter = w13.shape[1] // 2
    local = topk_ids.long() - expert_start  # [T, k]
    for i in range(t):
        for j in range(k):
            e = int(local[i, j])
            if not 0 <= e < w13.shape[0]:
                continue
            a = x[i][None]  # [1, H]
            y = (F.linear(a, w13[e]) if w13_scale is None
                 else fp8_weight_only_ref(a, w13[e], w13_scale[e]))[0]  # [2I], x's dtype
            gate, up = y[:inter].float(), y[inter:].float()
            act[i * k + j] = (F.silu(gate) * up).to(act.dtype)


def router_route_prenorm_ref(x: torch.Tensor, residual: torch.Tensor,
                             norm_weight: torch.Tensor, eps: float, w: torch.Tensor,
                             out_dtype: torch.dtype, top_k: int, scoring_func: str,
                             renormalize: bool, routed_scaling_factor: float = 1.0,
                             e_score_correction_bias: torch.Tensor | None = None,
                             round_dtype: torch.dtype | None = None, num_shared: int = 0,
                             n_group: int | None = None, topk_group: int | None = None
                             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """kernels/triton_router_route.router_route_prenorm's contract: normed, new_residual =
    rms_norm(x, norm_weight, eps, residual) (x [T, H], or [S, T, H] float32 partial sums),
    then router_route_ref on normed: (weights, ids, normed, new_residual)."""
    normed, new_residual = rms_norm_ref(x, norm_weight, eps, residual)
    weights, ids = router_route_ref(normed, w, out_dtype, top_k, scoring_func, renormalize,
                                    routed_scaling_factor, e_score_correction_bias,
                                    round_dtype, num_shared, n_group, topk_group)
    return weights, ids, normed, new_residual
