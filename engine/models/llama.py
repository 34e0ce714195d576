"""One decoder for the Llama family: Llama 2/3, Mistral, Qwen2 (qkv bias), Qwen3 (q/k norm),
SmolLM2. Tokens of every request in a step are packed into one flat [T, hidden] batch."""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from torch import nn

from engine.attention import AttentionMetadata, KernelSet, PagedAttention
from engine.config import ModelConfig
from engine.models import split_k
from engine.models.split_k import split_k_linear
from engine.parallel.dp_exchange import DPForward
from engine.parallel.dp_groups import ep_of
from engine.parallel.group import TPGroup
from engine.parallel.layers import ParallelLMHead, VocabParallelEmbedding
from engine.parallel.shards import TPShard, hf_slice, local_from_full, shard_for
from engine.quant.checkpoint import copy_scale, is_scale, param_name, scale_cut
from engine.quant.fp8_input import Fp8Input, wants_fp8_input
from engine.quant.fp8_linear import Fp8Linear
from engine.quant.scheme import Fp8Scheme
from engine.rope import cos_sin_table

# Qwen3's per-head q/k RMSNorms inside the RoPE + KV store kernel (kernels/triton_rope_kv.py);
# False runs them as their own launches on copies of q and k (what the kernel replaced; for
# A/B runs: bench/moe_bench.py --prefill-variants "engine.models.llama.FUSED_QK_NORM=False").
FUSED_QK_NORM = True


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float, kernels: KernelSet) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps
        self.k = kernels

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None,
                into: nn.Module | None = None
                ) -> tuple[torch.Tensor | Fp8Input, torch.Tensor]:
        """(normed, new residual). into: the one projection that reads the output; where it
        is an FP8 layer that would quantize it per row, the norm does (Fp8Input)."""
        quant = self.k.rms_norm_quant
        if into is not None and quant is not None and wants_fp8_input(into, x.shape[-2], quant):
            q, scale, res = quant(x, self.weight, self.eps, residual)
            dtype = residual.dtype if residual is not None else x.dtype
            return Fp8Input(q, scale, dtype), res
        out: tuple[torch.Tensor, torch.Tensor] = self.k.rms_norm(x, self.weight, self.eps,
                                                                  residual)
        return out

    def as_next_norm(self) -> tuple[RMSNorm, nn.Module | None]:
        """As the norm after the last decoder layer (DecoderLayer.forward's `after`): itself,
        read by the LM head as it is."""
        return self, None


class Attention(nn.Module):
    """This rank's query and KV heads; o_proj is row-parallel (one all-reduce). On one CUDA
    rank at few rows, qkv_proj, o_proj (and MLP's down_proj) leave float32 K-split partial
    sums that the next kernel (RoPE + KV store, RMSNorm) adds (engine/models/split_k.py)."""

    def __init__(self, cfg: ModelConfig, kernels: KernelSet, shard: TPShard,
                 group: TPGroup | None) -> None:
        super().__init__()
        self.nq, self.nkv, self.d = shard.num_heads, shard.num_kv_heads, cfg.head_dim
        self.group = group
        self.qkv_proj = nn.Linear(cfg.hidden_size, (self.nq + 2 * self.nkv) * self.d,
                                  bias=cfg.attention_bias)
        self.o_proj = nn.Linear(self.nq * self.d, cfg.hidden_size, bias=False)
        self.q_norm = RMSNorm(self.d, cfg.rms_norm_eps, kernels) if cfg.qk_norm else None
        self.k_norm = RMSNorm(self.d, cfg.rms_norm_eps, kernels) if cfg.qk_norm else None
        self.attn = PagedAttention(kernels, self.d**-0.5)
        self.k = kernels

    def forward(self, x: torch.Tensor | Fp8Input, positions: torch.Tensor,
                cos_sin: torch.Tensor, kv_layer: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        t = x.shape[0]
        parts = None
        norms = self._qk_norm()
        if (split_k.QKV and self.group is None and self.k.rope_store_kv is not None
                and (self.q_norm is None or (split_k.QK_NORM and norms is not None))):
            parts = split_k_linear(x, self.qkv_proj)  # [S, T, (Hq + 2 Hkv) D], summed by RoPE
        if parts is not None:
            heads = parts.unflatten(-1, (self.nq + 2 * self.nkv, self.d))
            q, k, v = heads.split([self.nq, self.nkv, self.nkv], dim=2)
            o = self.attn(q, k, v, kv_layer, meta, positions, cos_sin, out_dtype=x.dtype,
                          qk_norm=norms)
        else:
            qkv = self.qkv_proj(x)  # [T, (Hq + 2 Hkv) D]
            q, k, v = qkv.split([self.nq * self.d, self.nkv * self.d, self.nkv * self.d], -1)
            q = q.reshape(t, self.nq, self.d)
            k = k.reshape(t, self.nkv, self.d)
            v = v.reshape(t, self.nkv, self.d)
            if norms is None and self.q_norm is not None and self.k_norm is not None:
                q = self.q_norm(q.reshape(-1, self.d))[0].reshape(t, self.nq, self.d)
                k = self.k_norm(k.reshape(-1, self.d))[0].reshape(t, self.nkv, self.d)
            o = self.attn(q, k, v, kv_layer, meta, positions, cos_sin, qk_norm=norms)
        o = o.reshape(t, self.nq * self.d)
        if self.group is not None:
            return self.group.all_reduce(self.o_proj(o))
        parts = split_k_linear(o, self.o_proj)  # [S, T, H] for the next norm to sum
        return self.o_proj(o) if parts is None else parts

    def _qk_norm(self) -> tuple[torch.Tensor, torch.Tensor, float] | None:
        """The per-head q/k norms for the RoPE + KV store kernel to apply (FUSED_QK_NORM:
        no norm launches, no copies of the strided q and k); None: none, or run apart."""
        if self.q_norm is None or self.k_norm is None or not FUSED_QK_NORM:
            return None
        return (self.q_norm.weight, self.k_norm.weight, self.q_norm.eps)


class MLP(nn.Module):
    """gate/up column-parallel, down row-parallel: one all-reduce."""

    def __init__(self, cfg: ModelConfig, kernels: KernelSet, shard: TPShard,
                 group: TPGroup | None) -> None:
        super().__init__()
        self.inter = shard.inter_size
        self.group = group
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * self.inter, bias=False)
        self.down_proj = nn.Linear(self.inter, cfg.hidden_size, bias=False)
        self.k = kernels

    def forward(self, x: torch.Tensor | Fp8Input) -> torch.Tensor:
        act: torch.Tensor | Fp8Input | None = None
        if isinstance(self.gate_up_proj, Fp8Linear):  # decode rows: activation in the GEMV
            act = self.gate_up_proj.silu_glu(x)
        if act is None:
            gate_up = self.gate_up_proj(x)
            quant = self.k.silu_and_mul_quant
            if quant is not None and wants_fp8_input(self.down_proj, gate_up.shape[0], quant):
                q, scale = quant(gate_up)
                act = Fp8Input(q, scale, gate_up.dtype)
            else:
                act = self.k.silu_and_mul(gate_up)
        if self.group is not None:
            return self.group.all_reduce(self.down_proj(act))
        parts = split_k_linear(act, self.down_proj)  # [S, T, H] for the next norm to sum
        return self.down_proj(act) if parts is None else parts


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, kernels: KernelSet, shard: TPShard,
                 group: TPGroup | None, mlp: nn.Module | None = None,
                 attn: nn.Module | None = None) -> None:
        """mlp: the layer's MLP (x [T, H] -> [T, H] summed over the ranks, or K-split
        partials); None: the dense one. attn: its attention (same call as ``Attention``,
        e.g. MLA); None: the GQA one."""
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, kernels)
        self.self_attn = attn if attn is not None else Attention(cfg, kernels, shard, group)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, kernels)
        self.mlp = mlp if mlp is not None else MLP(cfg, kernels, shard, group)
        # The dense attention and MLP read their input only through their first
        # projection, so the norm before may hand it quantized (RMSNorm's `into`); other
        # families' modules (MoE routing, MLA) read it more ways.
        self.attn_in = attn is None
        self.mlp_in = mlp is None

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, positions: torch.Tensor,
                cos_sin: torch.Tensor, kv_layer: torch.Tensor, meta: AttentionMetadata,
                after: DecoderLayer | RMSNorm | None = None, normed: bool = False
                ) -> tuple[torch.Tensor, torch.Tensor, bool]:
        """(h, residual, whether h is already `after`'s norm of it). after: what follows
        this layer, the next layer (its input_layernorm) or the model's final norm, for an
        MLP that can run that norm in its own last launch (engine/models/moe.py's
        NEXT_NORM_FUSED); None: nothing may. normed: x is already this layer's
        input_layernorm output (the layer before ran it), residual the new residual."""
        if normed:
            assert residual is not None, "a layer's norm ran in the layer before"
            h: torch.Tensor | Fp8Input = x
        else:
            h, residual = self.input_layernorm(
                x, residual, self.self_attn.qkv_proj if self.attn_in else None)
        h = self.self_attn(h, positions, cos_sin, kv_layer, meta)
        # An MLP that can run the norm in its own first launch (engine/models/moe.py's
        # SparseMoeBlock.forward_prenorm), or the norm after it in its last
        # (forward_next_norm), is asked first; None from it: it does not here. Looked up
        # on the class, as duck typing: llama.py imports no family's MLP, and a miss on the
        # type raises nothing (nn.Module's instance lookup would). Not while hooks watch
        # the MLP (bench/moe_floor.py's routing census): they see its input only through
        # its own call.
        mlp = self.mlp
        then = None
        if not (mlp._forward_hooks or mlp._forward_pre_hooks):
            prenorm = getattr(type(mlp), "forward_prenorm", None)
            if prenorm is not None:
                done: tuple[torch.Tensor, torch.Tensor, bool] | None = prenorm(
                    mlp, h, residual, self.post_attention_layernorm, after)
                if done is not None:
                    return done
            if after is not None:
                then = getattr(type(mlp), "forward_next_norm", None)
        h, residual = self.post_attention_layernorm(
            h, residual, self.mlp.gate_up_proj if self.mlp_in else None)
        if then is not None:
            fused: tuple[torch.Tensor, torch.Tensor] | None = then(mlp, h, residual, after)
            if fused is not None:
                return fused[0], fused[1], True
        return self.mlp(h), residual, False

    def as_next_norm(self) -> tuple[RMSNorm, nn.Module | None]:
        """The layer's input_layernorm and the projection that reads its output (its
        `into`): the norm the layer before may run (forward's `after`)."""
        qkv = self.self_attn.qkv_proj if self.attn_in else None
        assert qkv is None or isinstance(qkv, nn.Module)
        return self.input_layernorm, qkv


class LlamaForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig, kernels: KernelSet, max_positions: int,
                 group: TPGroup | None = None) -> None:
        """group: this rank's tensor-parallel group (None: one rank holds everything)."""
        super().__init__()
        self.cfg = cfg
        self.kernels = kernels
        self.group = group if group is not None and group.size > 1 else None
        self.shard = shard_for(cfg, group.rank, group.size) if group else shard_for(cfg, 0, 1)
        g, sh = self.group, self.shard
        # data-parallel attention: the MoE layers' expert group and step state (dp_groups.py)
        self.ep_group = ep_of(group)
        self.dp_step = DPForward()
        # The checkpoint's FP8 scheme while its weights load (engine/quant); None: float
        self.quant: Fp8Scheme | None = None
        self.embed_tokens = VocabParallelEmbedding(sh, cfg.vocab_size, cfg.hidden_size, g)
        self.layers = nn.ModuleList(DecoderLayer(cfg, kernels, sh, g, self.make_mlp(i))
                                    for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, kernels)
        self.lm_head = ParallelLMHead(sh, cfg.vocab_size, cfg.hidden_size, g)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        scaling = dict(cfg.rope_scaling) if cfg.rope_scaling else None
        self.register_buffer(
            "cos_sin", cos_sin_table(cfg.head_dim, max_positions, cfg.rope_theta, scaling),
            persistent=False)
        # Called after each decoder layer's launches in an eager forward (LLMEngine sets it
        # for a producer's step alone, never while graphs capture): the host's launches are
        # most of an eager prefill step, and the worker loop takes the router's commands
        # between them rather than after the whole step.
        self.between_layers: Callable[[], None] | None = None

    def make_mlp(self, layer: int) -> nn.Module | None:
        """Layer `layer`'s MLP; None: the dense one. A family with other MLPs (MoE)
        overrides this; cfg, kernels, group and shard are set when it is called."""
        return None

    def local_from_full(self, name: str, full: torch.Tensor) -> torch.Tensor:
        """This rank's part of the TP1-shaped parameter `name` (dummy weights)."""
        return local_from_full(self.shard, self.cfg, name, full)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        """input_ids, positions: [T]; kv_cache: [NB, L, 2, BS, Hkv, D]. Returns [T, hidden]."""
        x = self.embed_tokens(input_ids)
        residual: torch.Tensor | None = None
        between = self.between_layers
        layers: list[DecoderLayer] = list(self.layers)  # type: ignore[arg-type]
        # each layer is handed what follows it, whose norm its MLP may run
        # (DecoderLayer.forward's `after`); the final norm not while hooks watch it
        # (bench/decode_op_count.py attributes the head's launches by its pre-hook)
        norm = self.norm
        final = None if norm._forward_hooks or norm._forward_pre_hooks else norm
        normed = False
        for i, layer in enumerate(layers):
            after = layers[i + 1] if i + 1 < len(layers) else final
            x, residual, normed = layer(x, residual, positions, self.cos_sin, kv_cache[:, i],
                                        meta, after, normed)
            if between is not None:
                between()
        return x if normed else norm(x, residual)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[S, hidden] -> [S, vocab] float32 (gathered over the ranks)."""
        out: torch.Tensor = self.lm_head(hidden)
        return out

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copies HF-named tensors into the fused layout; returns the names it used.
        Under TP the tensors may come whole or already sliced to this rank (see
        `wants`); whole ones are sliced here."""
        params = dict(self.named_parameters())
        nq, nkv, d = self.shard.num_heads, self.shard.num_kv_heads, self.cfg.head_dim
        qkv_rows = {"q_proj": (0, nq * d), "k_proj": (nq * d, nkv * d),
                    "v_proj": ((nq + nkv) * d, nkv * d)}
        inter = self.shard.inter_size
        mlp_rows = {"gate_proj": (0, inter), "up_proj": (inter, inter)}
        used: set[str] = set()
        for name, w in weights:
            name = param_name(name.removeprefix("model."))
            if "rotary_emb" in name:
                continue
            if name == "lm_head.weight" and self.cfg.tie_word_embeddings:
                continue
            target, rows = name, None
            for sub, span in qkv_rows.items():
                if f".{sub}." in name:
                    target, rows = name.replace(sub, "qkv_proj"), span
            for sub, span in mlp_rows.items():
                if f".{sub}." in name:
                    target, rows = name.replace(sub, "gate_up_proj"), span
            if target not in params:
                raise ValueError(f"model: unexpected weight {name!r} in checkpoint")
            if self.quant is not None and is_scale(name):
                copy_scale(params[target], rows, name, w, self.quant)
                used.add(name)
                continue
            self._copy_in(params[target], target, rows, name, self._rank_part(name, w))
            used.add(name)
        return used

    def _rank_part(self, name: str, w: torch.Tensor) -> torch.Tensor:
        """This rank's part of HF tensor ``name`` (it may come whole or already sliced)."""
        cut = self.cut_of(name)
        if cut is not None and w.shape[cut[0]] == self._full_dim(name, cut[0]) \
                and cut[2] - cut[1] != w.shape[cut[0]]:
            w = w.narrow(cut[0], cut[1], cut[2] - cut[1])
        return w

    def _copy_in(self, p: torch.Tensor, target: str, rows: tuple[int, int] | None,
                 name: str, w: torch.Tensor) -> None:
        """Copies HF tensor ``name`` into parameter ``target`` (``rows`` of it: a fused
        projection), refusing a shape that does not fit."""
        with torch.no_grad():
            dst = p if rows is None else p.narrow(0, rows[0], rows[1])
            if target in ("embed_tokens.weight", "lm_head.weight"):
                dst = dst.narrow(0, 0, self.shard.vocab_rows)  # the rest is padding
            if dst.shape != w.shape:
                raise ValueError(f"model: weight {name!r} has shape {tuple(w.shape)}, "
                                 f"expected {tuple(dst.shape)}")
            if (p.dtype == torch.float8_e4m3fn) != (w.dtype == torch.float8_e4m3fn):
                raise ValueError(f"model: weight {name!r} is {w.dtype}, where the checkpoint's "
                                 f"quantization_config makes the layer {p.dtype}")
            dst.copy_(w.to(p.dtype))

    def _full_dim(self, name: str, dim: int) -> int:
        return _full_dim(self.cfg, name, dim)

    def cut_of(self, hf_name: str) -> tuple[int, int, int] | None:
        """(dim, start, stop) of this rank's part of an HF tensor that came whole: the part
        `wants` reads, unless a model reads more than it keeps."""
        return self.wants(hf_name)

    def wants(self, hf_name: str) -> tuple[int, int, int] | None:
        """(dim, start, stop) of an HF tensor this rank needs; None: all of it."""
        cut = hf_slice(self.shard, hf_name, self.cfg.head_dim)
        if self.quant is not None and is_scale(hf_name):
            return scale_cut(self.quant, hf_name, cut, self.shard.size)
        return cut


def _full_dim(cfg: ModelConfig, name: str, dim: int) -> int:
    """An HF tensor's TP1 size along `dim` (the dims `hf_slice` cuts)."""
    d = cfg.head_dim
    if ".q_proj." in name or ".o_proj." in name:
        return cfg.num_heads * d
    if ".k_proj." in name or ".v_proj." in name:
        return cfg.num_kv_heads * d
    if "_proj." in name:  # gate, up, down
        return cfg.intermediate_size
    return cfg.vocab_size
