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


def fused_moe_ref(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                  topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                  expert_start: int = 0, config: dict[str, Any] | None = None) -> torch.Tensor:
    """x: [T, H]; w13: [E_local, 2I, H] = [gate | up] rows; w2: [E_local, H, I];
    topk_weights: [T, k] float32; topk_ids: [T, k] int (global expert ids).
    config: the Triton kernel's tile sizes, unused here. Returns [T, H] in x's dtype.
    The projections run in x's dtype as HF's experts do; the weighted sum over the top-k
    is kept in float32 and rounded once."""
    t, h = x.shape
    e_local, two_i, _ = w13.shape
    out = torch.zeros(t, h, dtype=torch.float32, device=x.device)  # [T, H]
    local = topk_ids.long() - expert_start  # [T, k]; outside [0, E_local): another rank's
    for e in range(e_local):
        # data-dependent shapes: fine for the CPU reference, which is never graph-captured
        tok, slot = torch.nonzero(local == e, as_tuple=True)  # [n], [n]
        if tok.numel() == 0:
            continue
        gate, up = F.linear(x[tok], w13[e]).split(two_i // 2, dim=-1)  # [n, I] each
        y = F.linear(F.silu(gate) * up, w2[e])  # [n, H]
        out.index_add_(0, tok, y.float() * topk_weights[tok, slot].float().unsqueeze(-1))
    return out.to(x.dtype)
