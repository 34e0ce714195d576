"""The one place that picks kernel implementations: Triton on CUDA, torch references on CPU.

Every attention call reads all keys and values from the paged cache after storing the
step's new ones, so chunked prefill, mixed batches and decode share one code path.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class AttentionMetadata:
    """What the runner hands every attention layer for one step (B requests, T tokens)."""

    slot_mapping: torch.Tensor  # [T] int64: cache slot (block * block_size + offset) per token
    block_tables: torch.Tensor  # [B, max_blocks] int32
    cu_seqlens_q: torch.Tensor  # [B + 1] int32: request b's tokens are [cu[b], cu[b+1])
    seq_lens: torch.Tensor  # [B] int32: context length after this step
    decode_only: bool  # every request contributes exactly one query
    # Host-known bound on seq_lens: sizes decode's split-K from the real contexts. None
    # (CUDA graphs, whose grid cannot change per step): the block table's capacity.
    max_seq_len: int | None = None
    # The same lengths as host lists when the step was planned on the host (eager steps;
    # None in CUDA graphs): MLA splits a mixed step's prefill and decode rows with them.
    cu_seqlens_q_host: list[int] | None = None
    seq_lens_host: list[int] | None = None
    # A prefill step replayed as a CUDA graph (engine/prefill_graphs.py): prefill attention
    # sizes its grid from shapes alone, and tokens after cu_seqlens_q[-1] are padding.
    fixed_grid: bool = False


@dataclass(frozen=True)
class KernelSet:
    store_kv: Callable[..., Any]
    prefill_attention: Callable[..., Any]
    decode_attention: Callable[..., Any]
    rms_norm: Callable[..., Any]
    rope: Callable[..., Any]
    name: str
    silu_and_mul: Callable[..., Any]
    # greedy / temperature-only draws (kernels.ref_sample.sample_simple_ref's contract)
    sample_simple: Callable[..., Any] | None = None
    # RoPE fused with store_kv (kernels.ref_rope_kv.rope_store_kv_ref's contract)
    rope_store_kv: Callable[..., Any] | None = None
    # mixture-of-experts MLP (kernels.ref_moe.fused_moe_ref's contract)
    fused_moe: Callable[..., Any] | None = None
    # top-k routing without expert groups (kernels.ref_moe.moe_route_ref's contract)
    moe_route: Callable[..., Any] | None = None
    # the router's logits for few tokens (kernels.ref_moe.router_logits_ref's contract)
    router_logits: Callable[..., Any] | None = None
    # MLA (engine/models/mla.py): the latent store (kernels.ref_kv.store_latent_ref) and
    # absorbed-form decode (kernels.ref_mla_decode.mla_decode_ref)
    store_latent: Callable[..., Any] | None = None
    mla_decode: Callable[..., Any] | None = None
    # MLA prefill on the decompressed context (kernels.ref_mla_prefill.mla_prefill_ref)
    mla_prefill: Callable[..., Any] | None = None
    # RMSNorm and SiLU x mul that quantize their output per row for an FP8 x FP8
    # projection (kernels.ref_norm.rms_norm_quant_ref, ref_act.silu_and_mul_quant_ref;
    # engine/quant/fp8_input.py); None: the projection quantizes its input itself
    rms_norm_quant: Callable[..., Any] | None = None
    silu_and_mul_quant: Callable[..., Any] | None = None

    @property
    def graph_safe(self) -> bool:
        """The Triton launchers never read device values on the host, so they can be
        captured in a CUDA graph; the torch references size their work from such values."""
        return self.name == "triton"


def kernels_for(device: torch.device, force_reference: bool = False) -> KernelSet:
    if device.type == "cuda" and not force_reference:
        from kernels.triton_act import silu_and_mul, silu_and_mul_quant
        from kernels.triton_decode_attention import decode_attention
        from kernels.triton_mla_decode import mla_decode
        from kernels.triton_mla_prefill import mla_prefill
        from kernels.triton_moe import fused_moe
        from kernels.triton_moe_route import moe_route
        from kernels.triton_norm import rms_norm, rms_norm_quant, rope
        from kernels.triton_prefill_attention import prefill_attention
        from kernels.triton_rope_kv import rope_store_kv
        from kernels.triton_router_logits import router_logits
        from kernels.triton_sample import sample_simple
        from kernels.triton_store_kv import store_kv, store_latent

        return KernelSet(store_kv, prefill_attention, decode_attention, rms_norm, rope, "triton",
                         silu_and_mul, sample_simple=sample_simple, rope_store_kv=rope_store_kv,
                         fused_moe=fused_moe, moe_route=moe_route, store_latent=store_latent,
                         mla_decode=mla_decode, mla_prefill=mla_prefill,
                         rms_norm_quant=rms_norm_quant,
                         silu_and_mul_quant=silu_and_mul_quant, router_logits=router_logits)
    from kernels.ref_act import silu_and_mul_quant_ref, silu_and_mul_ref
    from kernels.ref_attention import decode_attention_ref, prefill_attention_ref
    from kernels.ref_kv import store_kv_ref, store_latent_ref
    from kernels.ref_mla_decode import mla_decode_ref
    from kernels.ref_mla_prefill import mla_prefill_ref
    from kernels.ref_moe import fused_moe_ref, moe_route_ref, router_logits_ref
    from kernels.ref_norm import rms_norm_quant_ref, rms_norm_ref, rope_ref
    from kernels.ref_rope_kv import rope_store_kv_ref
    from kernels.ref_sample import sample_simple_ref

    return KernelSet(store_kv_ref, prefill_attention_ref, decode_attention_ref, rms_norm_ref,
                     rope_ref, "torch-reference", silu_and_mul_ref,
                     sample_simple=sample_simple_ref, rope_store_kv=rope_store_kv_ref,
                     fused_moe=fused_moe_ref, moe_route=moe_route_ref,
                     store_latent=store_latent_ref, mla_decode=mla_decode_ref,
                     mla_prefill=mla_prefill_ref,
                     rms_norm_quant=rms_norm_quant_ref,
                     silu_and_mul_quant=silu_and_mul_quant_ref, router_logits=router_logits_ref)


class PagedAttention:
    def __init__(self, kernels: KernelSet, scale: float) -> None:
        self.k = kernels
        self.scale = scale
        # A float8 cache's scales for this layer (engine/kv_scales.py sets them before any
        # step; host floats, so a captured graph holds them as constants)
        self.k_scale = 1.0
        self.v_scale = 1.0

    def __call__(
        self,
        q: torch.Tensor,  # [T, Hq, D], before RoPE
        k: torch.Tensor,  # [T, Hkv, D], before RoPE
        v: torch.Tensor,  # [T, Hkv, D]
        kv_layer: torch.Tensor,  # [NB, 2, BS, Hkv, D]
        meta: AttentionMetadata,
        positions: torch.Tensor,  # [T]
        cos_sin: torch.Tensor,  # [max_pos, D] float32
        out_dtype: torch.dtype | None = None,  # q, k, v: [S, T, H, D] float32 partial sums
        qk_norm: tuple[torch.Tensor, torch.Tensor, float] | None = None,  # per-head RMSNorm
    ) -> torch.Tensor:  # [T, Hq, D]
        """Normalizes each head of q and k (qk_norm: their weights and eps), rotates them,
        stores k and v (one fused kernel), then attends."""
        ks, vs = self.k_scale, self.v_scale
        if out_dtype is not None:  # a K-split qkv_proj's partials (engine/models/split_k)
            assert self.k.rope_store_kv is not None
            q = self.k.rope_store_kv(q, k, v, positions, cos_sin, kv_layer, meta.slot_mapping,
                                     out_dtype=out_dtype, k_scale=ks, v_scale=vs,
                                     qk_norm=qk_norm)
        elif self.k.rope_store_kv is not None:
            q = self.k.rope_store_kv(q, k, v, positions, cos_sin, kv_layer, meta.slot_mapping,
                                     k_scale=ks, v_scale=vs, qk_norm=qk_norm)
        else:
            if qk_norm is not None:
                qw, kw, eps = qk_norm
                q = self.k.rms_norm(q.reshape(-1, q.shape[-1]), qw, eps)[0].view(q.shape)
                k = self.k.rms_norm(k.reshape(-1, k.shape[-1]), kw, eps)[0].view(k.shape)
            q, k = self.k.rope(q, k, positions, cos_sin)
            self.k.store_kv(k, v, kv_layer, meta.slot_mapping, k_scale=ks, v_scale=vs)
        if meta.decode_only:
            return self.k.decode_attention(q, kv_layer, meta.block_tables, meta.seq_lens,
                                           self.scale, max_seq_len=meta.max_seq_len,
                                           k_scale=ks, v_scale=vs)
        # max_seq_len sizes the Triton kernel's key split (a short chunk after a long cached
        # prefix is too few query tiles to fill the GPU; kernels/triton_prefill_split.py).
        return self.k.prefill_attention(q, kv_layer, meta.block_tables, meta.cu_seqlens_q,
                                        meta.seq_lens, self.scale,
                                        max_seq_len=meta.max_seq_len, k_scale=ks, v_scale=vs,
                                        fixed_grid=meta.fixed_grid)
