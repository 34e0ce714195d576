"""What a MoE model's decode step must read, for moe_bench.py's byte floor: the weights
besides the experts, one expert's bytes, the distinct experts a batch routes to, and the
KV values a layer stores per token."""

from __future__ import annotations

from typing import Any

import torch


def moe_blocks(model: Any) -> list[Any]:
    from engine.models.moe import SparseMoeBlock

    return [layer.mlp for layer in model.layers if isinstance(layer.mlp, SparseMoeBlock)]


EXPERT_PARAMS = ("experts.w13", "experts.w2", "experts.w13_scale", "experts.w2_scale")


def expert_bytes(block: Any) -> int:
    """One expert's weight bytes (gate, up and down; FP8 experts: with their scales)."""
    e = block.experts
    return sum(t[0].numel() * t.element_size()
               for t in (e.w13, e.w2, e.w13_scale, e.w2_scale) if t is not None)


def expert_params(block: Any) -> int:
    """One expert's weights (gate, up and down), counted in values."""
    return int(block.experts.w13[0].numel() + block.experts.w2[0].numel())


def _dense(model: Any) -> list[tuple[str, torch.Tensor]]:
    """The weights a step reads whole besides the stacked experts: all but the embedding
    table (a step reads only its rows), unless the head is tied to it. named_parameters()
    gives a tied tensor once, under the embedding's name, and the head reads all of it."""
    tied = model.cfg.tie_word_embeddings
    return [(name, p) for name, p in model.named_parameters()
            if not name.endswith(EXPERT_PARAMS) and (tied or "embed_tokens" not in name)]


def dense_weight_bytes(model: Any) -> int:
    """Bytes of weights a decode step reads besides experts (_dense)."""
    return sum(p.numel() * p.element_size() for _, p in _dense(model))


def dense_weight_params(model: Any) -> int:
    """dense_weight_bytes' weights counted in values (scales left out)."""
    return sum(p.numel() for name, p in _dense(model)
               if not name.endswith(("weight_scale", "input_scale")))


def touched_experts(engine: Any) -> list[int]:
    """Distinct experts each MoE layer routed the running batch to, in one eager step."""
    blocks = moe_blocks(engine.runner.model)
    seen: list[int] = [0] * len(blocks)
    hooks = []
    for i, blk in enumerate(blocks):
        def hook(mod: Any, args: tuple[Any, ...], out: Any, i: int = i) -> None:
            _, ids = mod.route(args[0])
            seen[i] = int(torch.unique(ids).numel())
        hooks.append(blk.register_forward_hook(hook))
    graphs = engine.runner.graphs
    prev = graphs.use_graphs
    graphs.use_graphs = False  # an eager step, so the hooks run (replays run no Python)
    try:
        engine.step()
        engine.step()  # deferred output: the second step is the first one fully read
    finally:
        graphs.use_graphs = prev
        for h in hooks:
            h.remove()
    return seen


def kv_values_per_token(cfg: Any) -> int:
    """KV values one layer stores per token: the latent + rope key (MLA), else K and V."""
    if cfg.is_mla:
        return cfg.kv_lora_rank + cfg.qk_rope_head_dim
    return 2 * cfg.num_kv_heads * cfg.head_dim
