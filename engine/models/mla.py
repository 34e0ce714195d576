"""DeepSeek's multi-head latent attention (MLA) over a paged latent cache.

Per token and layer the cache stores one latent row ``[c | k_pe]`` (engine/kv_layout.py,
kind "mla"): ``c`` is the compressed KV after kv_a_layernorm (C = kv_lora_rank values) and
``k_pe`` the roped key every head shares (R = qk_rope_head_dim). Keys and values per head
come from ``c`` through kv_b_proj, whose weight is, per head, W_UK [Dn, C] (the key's
non-rotated part) stacked on W_UV [Dv, C] (the value).

- Prefill (and any step with more than one query per request) decompresses the context's
  latent rows, prior chunks' included, into per-head K [Dn | R] and V and runs the dense
  paged prefill attention on them: its FLOPs are those of ordinary attention, and a
  chunk needs no latent-specific kernel.
- Decode runs in the absorbed form: q_nope goes through W_UK onto the latent, attention
  is multi-query over the latent rows themselves (kernels/triton_mla_decode.py), and the
  result goes through W_UV. A step then reads C + R values per token instead of
  H * (Dn + R + Dv).

Tensor parallelism: query heads (q_proj / q_b_proj rows, kv_b_proj rows, o_proj columns)
split by head; q_a_proj, kv_a_proj_with_mqa and their norms are replicated, so every rank
computes and stores the same latent. o_proj is row-parallel: one all-reduce.
"""

from __future__ import annotations

import torch
from torch import nn

from engine.attention import AttentionMetadata, KernelSet
from engine.config import ModelConfig
from engine.models.llama import RMSNorm
from engine.parallel.group import TPGroup
from engine.parallel.shards import TPShard
from engine.rope import softmax_mscale


class MLAAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, kernels: KernelSet, shard: TPShard,
                 group: TPGroup | None) -> None:
        super().__init__()
        self.h = shard.num_heads  # this rank's query heads
        self.dn, self.r = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim
        self.dv, self.c = cfg.v_head_dim, cfg.kv_lora_rank
        self.group = group
        self.k = kernels
        hidden, qk = cfg.hidden_size, self.dn + self.r
        if cfg.q_lora_rank is None:
            self.q_proj: nn.Linear | None = nn.Linear(hidden, self.h * qk, bias=False)
            self.q_a_proj = self.q_b_proj = None
            self.q_a_layernorm = None
        else:
            self.q_proj = None
            self.q_a_proj = nn.Linear(hidden, cfg.q_lora_rank, bias=False)
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, cfg.rms_norm_eps, kernels)
            self.q_b_proj = nn.Linear(cfg.q_lora_rank, self.h * qk, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(hidden, self.c + self.r, bias=False)
        self.kv_a_layernorm = RMSNorm(self.c, cfg.rms_norm_eps, kernels)
        self.kv_b_proj = nn.Linear(self.c, self.h * (self.dn + self.dv), bias=False)
        self.o_proj = nn.Linear(self.h * self.dv, hidden, bias=False)
        scaling = dict(cfg.rope_scaling) if cfg.rope_scaling else None
        # YaRN's mscale correction (transformers' yarn_apply_mscale)
        self.scale = qk ** -0.5 * softmax_mscale(scaling)
        # the dense prefill kernel's head dim: K [Dn | R] and V zero-padded to one power of
        # two (zeros add nothing to q.k, and V's padding columns are cut off after)
        self.pad_dim = max(16, 1 << (max(qk, self.dv) - 1).bit_length())

    def forward(self, x: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor,
                kv_layer: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """x [T, hidden]; cos_sin [max_pos, R]; kv_layer [NB, 1, BS, 1, C + R]."""
        t = x.shape[0]
        if self.q_proj is not None:
            q = self.q_proj(x)
        else:
            assert self.q_a_proj is not None and self.q_a_layernorm is not None \
                and self.q_b_proj is not None
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x))[0])
        q = q.view(t, self.h, self.dn + self.r)
        q_nope, q_pe = q.split([self.dn, self.r], dim=-1)  # [T, H, Dn], [T, H, R]
        kv_a = self.kv_a_proj_with_mqa(x)  # [T, C + R]
        c = self.kv_a_layernorm(kv_a[:, :self.c].contiguous())[0]  # [T, C]
        # DeepSeek's interleaved rope pairs were de-interleaved in the weights at load
        # (load_weights), so the rotate-half kernel applies.
        q_pe, k_pe = self.k.rope(q_pe.contiguous(), kv_a[:, None, self.c:].contiguous(),
                                 positions, cos_sin)  # [T, H, R], [T, 1, R]
        latent = torch.cat([c, k_pe.view(t, self.r)], dim=-1)  # [T, C + R]
        assert self.k.store_latent is not None
        self.k.store_latent(latent, kv_layer, meta.slot_mapping)
        if meta.decode_only:
            o = self._decode(q_nope, q_pe, kv_layer, meta)
        else:
            o = self._prefill(q_nope, q_pe, kv_layer, meta)
        out = self.o_proj(o.reshape(t, self.h * self.dv))
        return out if self.group is None else self.group.all_reduce(out)

    def _w_uk_uv(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Views of kv_b_proj's weight: W_UK [H, Dn, C] and W_UV [H, Dv, C]."""
        w = self.kv_b_proj.weight.view(self.h, self.dn + self.dv, self.c)
        return w[:, :self.dn], w[:, self.dn:]

    def _decode(self, q_nope: torch.Tensor, q_pe: torch.Tensor, kv_layer: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:  # [B, H, Dv]
        w_uk, w_uv = self._w_uk_uv()
        q_lat = torch.bmm(q_nope.transpose(0, 1), w_uk)  # [H, B, C]
        q = torch.cat([q_lat.transpose(0, 1), q_pe], dim=-1)  # [B, H, C + R]
        assert self.k.mla_decode is not None
        o_lat = self.k.mla_decode(q, kv_layer, meta.block_tables, meta.seq_lens, self.scale,
                                  self.c, max_seq_len=meta.max_seq_len)  # [B, H, C]
        return torch.bmm(o_lat.transpose(0, 1), w_uv.transpose(1, 2)).transpose(0, 1)

    def _prefill(self, q_nope: torch.Tensor, q_pe: torch.Tensor, kv_layer: torch.Tensor,
                 meta: AttentionMetadata) -> torch.Tensor:  # [T, H, Dv]
        """Decompresses every block the step's tables name (no host sync: padding entries
        are decompressed too, and never read) into a dense paged K/V of this rank's heads,
        then runs the dense paged prefill attention on it."""
        bt = meta.block_tables  # [B, W]
        b, w = bt.shape
        bs = kv_layer.shape[2]
        lat = kv_layer[bt.reshape(-1).long(), 0, :, 0]  # [B*W, BS, C + R]
        kv = self.kv_b_proj(lat[..., :self.c])  # [B*W, BS, H * (Dn + Dv)]
        kv = kv.view(b * w, bs, self.h, self.dn + self.dv)
        d = self.pad_dim
        paged = kv.new_zeros(b * w, 2, bs, self.h, d)  # [B*W, 2, BS, H, D]
        paged[:, 0, :, :, :self.dn] = kv[..., :self.dn]
        paged[:, 0, :, :, self.dn:self.dn + self.r] = lat[:, :, None, self.c:]
        paged[:, 1, :, :, :self.dv] = kv[..., self.dn:]
        t = q_nope.shape[0]
        q = q_nope.new_zeros(t, self.h, d)
        q[..., :self.dn] = q_nope
        q[..., self.dn:self.dn + self.r] = q_pe
        tables = torch.arange(b * w, dtype=torch.int32, device=bt.device).view(b, w)
        o = self.k.prefill_attention(q, paged, tables, meta.cu_seqlens_q, meta.seq_lens,
                                     self.scale)  # [T, H, D]
        return o[..., :self.dv]
