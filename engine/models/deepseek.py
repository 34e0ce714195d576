"""DeepSeek-V2 / V3: MLA attention (engine/models/mla.py) and, per layer, the dense MLP of
the Llama family or DeepSeek's mixture of experts (engine/models/moe.py).

The model reuses LlamaForCausalLM's forward (embedding, layers over the block-major cache,
final norm) and its LM head; what differs is the layers, the RoPE table (qk_rope_head_dim
wide, YaRN) and the weight names. Weight handling is two cooperating classes, in this MRO:
DeepseekForCausalLM -> MoeForCausalLM (router, shared and routed experts; every other
tensor goes to super()) -> _DeepseekDense (MLA attention, dense MLP, embedding, head) ->
LlamaForCausalLM.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

import torch
from torch import nn

from engine.attention import KernelSet
from engine.config import ModelConfig
from engine.models.llama import DecoderLayer, LlamaForCausalLM, RMSNorm
from engine.models.mla import MLAAttention
from engine.models.moe import parse_expert_name
from engine.models.moe_model import MoeForCausalLM
from engine.parallel.dp_exchange import DPForward
from engine.parallel.dp_groups import ep_of
from engine.parallel.group import TPGroup
from engine.parallel.layers import ParallelLMHead, VocabParallelEmbedding
from engine.parallel.shards import hf_slice, local_from_full, shard_for
from engine.quant.dequantize import dequantized
from engine.rope import cos_sin_table

_LAYER = re.compile(r"layers\.(\d+)\.")


class _DeepseekDense(LlamaForCausalLM):
    """Everything but the MoE blocks' weights (see the module docstring)."""

    def __init__(self, cfg: ModelConfig, kernels: KernelSet, max_positions: int,
                 group: TPGroup | None = None) -> None:
        """group: this rank's tensor-parallel group (None: one rank holds everything)."""
        nn.Module.__init__(self)  # LlamaForCausalLM's would build Llama layers
        assert cfg.is_mla, cfg.arch
        self.cfg = cfg
        self.kernels = kernels
        self.group = group if group is not None and group.size > 1 else None
        self.shard = shard_for(cfg, group.rank, group.size) if group else shard_for(cfg, 0, 1)
        g, sh = self.group, self.shard
        # data-parallel attention: the MoE layers' expert group and step state (dp_groups.py)
        self.ep_group = ep_of(group)
        self.dp_step = DPForward()
        self.followers = None
        self.quant = None  # an FP8 checkpoint's scheme while it loads (as LlamaForCausalLM)
        self.between_layers = None  # the producer's command hook (as LlamaForCausalLM)
        self.embed_tokens = VocabParallelEmbedding(sh, cfg.vocab_size, cfg.hidden_size, g)
        self.layers = nn.ModuleList(
            DecoderLayer(cfg, kernels, sh, g, self.make_mlp(i),
                         attn=MLAAttention(cfg, kernels, sh, g))
            for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, kernels)
        self.lm_head = ParallelLMHead(sh, cfg.vocab_size, cfg.hidden_size, g)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        scaling = dict(cfg.rope_scaling) if cfg.rope_scaling else None
        self.register_buffer(
            "cos_sin", cos_sin_table(cfg.qk_rope_head_dim, max_positions, cfg.rope_theta,
                                     scaling), persistent=False)

    # ---- weights ----------------------------------------------------------------------------

    def _head_span(self, name: str) -> tuple[int, int] | None:
        """(dim, per-head width) of an attention tensor split by query head; None if not."""
        c = self.cfg
        if ".q_proj." in name or ".q_b_proj." in name:
            return 0, c.qk_nope_head_dim + c.qk_rope_head_dim
        if ".kv_b_proj." in name:
            return 0, c.qk_nope_head_dim + c.v_head_dim
        if ".o_proj." in name:
            return 1, c.v_head_dim
        return None

    def wants(self, hf_name: str) -> tuple[int, int, int] | None:
        """(dim, start, stop) of an HF tensor this rank needs; None: all of it. An FP8
        checkpoint's tensors are read whole (engine/quant/dequantize.py makes them float
        with their scales, whose cut would be in block units), then cut (`cut_of`)."""
        return None if self.quant is not None else self.cut_of(hf_name)

    def cut_of(self, hf_name: str) -> tuple[int, int, int] | None:
        sh = self.shard
        if sh.size == 1:
            return None
        span = self._head_span(hf_name)
        if span is not None:
            dim, width = span
            return dim, sh.q_start * width, (sh.q_start + sh.num_heads) * width
        if "_a_proj" in hf_name or "layernorm" in hf_name:
            return None  # the latent's and the query LoRA's down-projections: replicated
        return hf_slice(sh, hf_name, self.cfg.head_dim)

    def local_from_full(self, name: str, full: torch.Tensor) -> torch.Tensor:
        """This rank's part of a full (TP1-shaped) parameter, for dummy weights."""
        span = self._head_span(name)
        if span is not None:
            dim, width = span
            return full.narrow(dim, self.shard.q_start * width, self.shard.num_heads * width)
        if "_a_proj" in name or "layernorm" in name:
            return full
        return local_from_full(self.shard, self.cfg, name, full)

    def _full_dim(self, name: str, dim: int) -> int:
        span = self._head_span(name)
        if span is not None:
            return self.cfg.num_heads * span[1]
        if "_proj." in name:  # the dense MLP's gate, up, down
            return self.cfg.intermediate_size
        return self.cfg.vocab_size

    def _deinterleave(self, name: str, w: torch.Tensor) -> torch.Tensor:
        """DeepSeek rotates (x0, x1), (x2, x3)... pairs; reordering the rows that produce
        q_pe and k_pe to (x0, x2, ..., x1, x3, ...) makes that the rotate-half rotation the
        kernels do, and q.k is unchanged (both sides move the same way)."""
        c = self.cfg
        r = c.qk_rope_head_dim
        perm = torch.cat([torch.arange(0, r, 2), torch.arange(1, r, 2)])
        if ".q_proj." in name or ".q_b_proj." in name:
            per_head = c.qk_nope_head_dim + r
            heads = w.view(-1, per_head, *w.shape[1:])
            return torch.cat([heads[:, :c.qk_nope_head_dim],
                              heads[:, c.qk_nope_head_dim:][:, perm]], dim=1).view_as(w)
        if ".kv_a_proj_with_mqa." in name:
            return torch.cat([w[:c.kv_lora_rank], w[c.kv_lora_rank:][perm]], dim=0)
        return w

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copies HF-named tensors in; returns the names of the parameters it filled.
        Under TP the tensors may come whole or already sliced to this rank (`wants`)."""
        params = dict(self.named_parameters())
        inter = self.shard.inter_size
        mlp_rows = {"gate_proj": (0, inter), "up_proj": (inter, inter)}
        used: set[str] = set()
        for name, w in weights:
            name = name.removeprefix("model.")
            if "rotary_emb" in name:
                continue
            if name == "lm_head.weight" and self.cfg.tie_word_embeddings:
                continue
            m = _LAYER.match(name)
            if m and int(m.group(1)) >= self.cfg.num_layers:
                continue  # V3's multi-token-prediction layers: a draft model, not run here
            target, rows = name, None
            for sub, span in mlp_rows.items():
                if f".mlp.{sub}." in name:
                    target, rows = name.replace(sub, "gate_up_proj"), span
            if target not in params:
                raise ValueError(f"model: unexpected weight {name!r} in checkpoint")
            w = self._rank_part(name, w)
            if self.cfg.rope_interleave:
                w = self._deinterleave(name, w)
            self._copy_in(params[target], target, rows, name, w)
            used.add(target)
        return used


class DeepseekForCausalLM(MoeForCausalLM, _DeepseekDense):
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Returns the names of the parameters it filled (the MoE loader reports the shared
        experts' by HF name: gate_proj and up_proj fill our fused gate_up_proj). An FP8
        checkpoint's routed experts load FP8; its other FP8 tensors load dequantized."""
        if self.quant is not None:
            weights = dequantized(weights, self.quant,
                                  keep=lambda n: parse_expert_name(n) is not None)
        used = super().load_weights(weights)
        return {_SHARED_GATE_UP.sub(r"\1.gate_up_proj.", n) for n in used}


_SHARED_GATE_UP = re.compile(r"(\.shared_experts)\.(?:gate|up)_proj\.")
