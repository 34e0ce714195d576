"""Torch reference of RoPE fused with the KV store: rotate q and k, write k and v into
the paged cache, return the rotated q (see ref_norm.rope_ref and ref_kv.store_kv_ref)."""

from __future__ import annotations

import torch

from kernels.ref_kv import store_kv_ref
from kernels.ref_norm import rms_norm_ref, rope_ref


def rope_store_kv_ref(
    q: torch.Tensor,  # [T, Hq, D]
    k: torch.Tensor,  # [T, Hkv, D]
    v: torch.Tensor,  # [T, Hkv, D]
    positions: torch.Tensor,  # [T] int64
    cos_sin: torch.Tensor,  # [max_pos, D] float32: cos in [:, :D/2], sin in [:, D/2:]
    kv_layer: torch.Tensor,  # [NB, 2, BS, Hkv, D]
    slot_mapping: torch.Tensor,  # [T]: slot = block * BS + offset; < 0 skips the token
    out_dtype: torch.dtype | None = None,  # with [S, T, H, D] float32 partial sums
    *,
    k_scale: float = 1.0,  # float8 cache: this layer's K and V scales (ref_kv.store_kv_ref)
    v_scale: float = 1.0,
    # (q's weight [D], k's weight [D], eps): each head of q and k RMS-normed first (Qwen3)
    qk_norm: tuple[torch.Tensor, torch.Tensor, float] | None = None,
) -> torch.Tensor:  # [T, Hq, D]: rotated q
    if q.dim() == 4:  # K-split partial sums: the projection's output, rounded
        assert out_dtype is not None, "out_dtype: required with partial sums"
        q, k, v = (x.sum(0).to(out_dtype) for x in (q, k, v))
    if qk_norm is not None:
        qw, kw, eps = qk_norm
        d = q.shape[-1]
        q = rms_norm_ref(q.reshape(-1, d), qw, eps)[0].view(q.shape)
        k = rms_norm_ref(k.reshape(-1, d), kw, eps)[0].view(k.shape)
    q_rot, k_rot = rope_ref(q, k, positions, cos_sin)
    store_kv_ref(k_rot, v, kv_layer, slot_mapping, k_scale=k_scale, v_scale=v_scale)
    return q_rot
