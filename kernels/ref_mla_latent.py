"""Torch reference of the MLA step's latent kernel (kernels/triton_mla_latent.py's
contract): the new token's latent row normalized, its shared key and the queries' rope
parts rotated, the row stored in the paged latent cache."""

from __future__ import annotations

import torch

from kernels.ref_kv import store_latent_ref
from kernels.ref_norm import rms_norm_ref, rope_ref


def mla_latent_store_ref(
    kv_a: torch.Tensor,  # [T, C + R]: kv_a_proj_with_mqa's output, [c | k_pe] before both
    q: torch.Tensor,  # [T, H, Dn + R]: the queries, [q_nope | q_pe]; q_pe rotated in place
    norm_weight: torch.Tensor,  # [C]: kv_a_layernorm's
    eps: float,
    positions: torch.Tensor,  # [T] int
    cos_sin: torch.Tensor,  # [max_pos, R] float32: cos in [:, :R/2], sin in [:, R/2:]
    kv_layer: torch.Tensor,  # [NB, 1, BS, 1, C + R]
    slot_mapping: torch.Tensor,  # [T] int; < 0 skips the store
    *,
    scale: float = 1.0,  # float8 cache: this layer's latent scale
    q_pe_out: torch.Tensor | None = None,  # [T, H, R]: where the rotated q_pe goes
) -> None:
    """Stores [rms_norm(c) | rope(k_pe)] per token and rotates q's rope part (in place, or
    into q_pe_out), rounding where the separate kernels (RMSNorm, RoPE, latent store)
    round."""
    t, width = kv_a.shape
    r = cos_sin.shape[1]
    c = width - r
    dn = q.shape[2] - r
    normed = rms_norm_ref(kv_a[:, :c], norm_weight, eps)[0]  # [T, C]
    q_pe, k_pe = rope_ref(q[..., dn:], kv_a[:, None, c:], positions, cos_sin)
    (q[..., dn:] if q_pe_out is None else q_pe_out).copy_(q_pe)
    store_latent_ref(torch.cat([normed, k_pe.view(t, r)], dim=-1), kv_layer, slot_mapping,
                     scale=scale)


def mla_latent_absorb_ref(
    kv_a: torch.Tensor, q: torch.Tensor, norm_weight: torch.Tensor, eps: float,
    positions: torch.Tensor, cos_sin: torch.Tensor, kv_layer: torch.Tensor,
    slot_mapping: torch.Tensor,
    q_nope: torch.Tensor,  # [T, H, Dn]
    w_uk: torch.Tensor,  # [H, Dn, C]
    out: torch.Tensor,  # [T, H, C]: q_nope @ W_UK per head
    *,
    scale: float = 1.0,
    q_pe_out: torch.Tensor | None = None,
) -> None:
    """kernels/triton_mla_latent_absorb.mla_latent_absorb's contract: the latent store above
    and the queries onto the latent (q_nope @ W_UK, summed in float32, rounded once)."""
    mla_latent_store_ref(kv_a, q, norm_weight, eps, positions, cos_sin, kv_layer,
                         slot_mapping, scale=scale, q_pe_out=q_pe_out)
    prod = torch.bmm(q_nope.float().transpose(0, 1), w_uk.float()).transpose(0, 1)
    out.copy_(prod.to(out.dtype))
