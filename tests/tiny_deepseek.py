"""Small random DeepSeek-V2/V3 models (MLA attention) saved by transformers, shared by tests
(importable: tests/ is on pytest's pythonpath)."""

from __future__ import annotations

from typing import Any

import torch

# hidden 64, 4 heads; latent 32 + rope 16; per head: nope 16, rope 16, value 24 (V's width
# differs from K's on purpose)
BASE: dict[str, Any] = dict(
    hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    vocab_size=256, max_position_embeddings=512, kv_lora_rank=32, qk_nope_head_dim=16,
    qk_rope_head_dim=16, v_head_dim=24, first_k_dense_replace=2, n_routed_experts=8,
    num_experts_per_tok=2, moe_intermediate_size=32,
    # a wide init makes logits peaked, so greedy argmax is far from ties
    initializer_range=0.3, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
    pad_token_id=0)
YARN = {"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0,
        "original_max_position_embeddings": 128, "mscale": 1.0, "mscale_all_dim": 0.8}
# MoE: layer 0 dense (first_k_dense_replace 1), layer 1 eight routed experts in 4 groups
MOE: dict[str, Any] = dict(first_k_dense_replace=1, n_routed_experts=8, num_experts_per_tok=2,
                           n_group=4, topk_group=2, moe_intermediate_size=32)
MODELS: dict[str, tuple[str, dict[str, Any]]] = {
    # q_proj (no q LoRA), softmax routing, group-limited greedy top-k, 2 shared experts
    "v2": ("v2", dict(MOE, q_lora_rank=None, topk_method="group_limited_greedy",
                      n_shared_experts=2)),
    # q LoRA, YaRN with an mscale correction on both cos/sin and the softmax scale; sigmoid
    # routing with a score-correction bias (noaux_tc), renormalized and scaled, 1 shared
    "v3": ("v3", dict(MOE, q_lora_rank=24, rope_parameters=YARN, n_shared_experts=1,
                      routed_scaling_factor=2.5, norm_topk_prob=True)),
    # dense layers, rotate-half rope
    "v3-noninterleaved": ("v3", dict(q_lora_rank=24, rope_interleave=False)),
}


def make_tiny_deepseek(path: str, version: str, seed: int = 0, **overrides: Any) -> str:
    import transformers as tf

    cfg_cls, model_cls = ((tf.DeepseekV2Config, tf.DeepseekV2ForCausalLM) if version == "v2"
                          else (tf.DeepseekV3Config, tf.DeepseekV3ForCausalLM))
    torch.manual_seed(seed)
    model = model_cls(cfg_cls(**{**BASE, **overrides})).eval()
    with torch.no_grad():  # transformers inits the bias to zeros: give it something to do
        for layer in model.model.layers:
            bias = getattr(layer.mlp, "gate", None)
            if bias is not None and hasattr(bias, "e_score_correction_bias"):
                bias.e_score_correction_bias.normal_(0, 0.3)
    model.save_pretrained(path, safe_serialization=True)
    return path


def engine_logits(path: str, prompt: list[int], chunk: int, host: bool) -> torch.Tensor:
    """[len(prompt), vocab]: the prompt but its last token prefilled in chunks of `chunk`
    (each reading the previous chunks' latent from the paged cache), then the last token
    as a decode step (the absorbed form). host: the chunks' lengths come as host lists too
    (as the engine's planned steps give them), so MLA decompresses only the request's own
    blocks; else every block of the table."""
    from engine.attention import AttentionMetadata, kernels_for
    from engine.weights import build_model, read_model_config

    cfg = read_model_config(path)
    cpu = torch.device("cpu")
    model = build_model(path, cfg, kernels_for(cpu), cpu, "float32", "auto", 512)
    bs = 4
    nb = -(-len(prompt) // bs)
    kv = torch.zeros(nb + 2, cfg.num_layers, 1, bs, 1, cfg.kv_lora_rank + cfg.qk_rope_head_dim)
    blocks = list(range(nb + 1, 1, -1))  # scattered: block i of the prompt is not block i
    table = torch.tensor([blocks], dtype=torch.int32)
    out = []
    spans = [(s, min(s + chunk, len(prompt) - 1)) for s in range(0, len(prompt) - 1, chunk)]
    for start, end in [*spans, (len(prompt) - 1, len(prompt))]:
        pos = torch.arange(start, end)
        meta = AttentionMetadata(
            slot_mapping=torch.tensor([blocks[p // bs] * bs + p % bs for p in pos.tolist()]),
            block_tables=table, cu_seqlens_q=torch.tensor([0, end - start], dtype=torch.int32),
            seq_lens=torch.tensor([end], dtype=torch.int32), decode_only=end - start == 1,
            max_seq_len=end, cu_seqlens_q_host=[0, end - start] if host else None,
            seq_lens_host=[end] if host else None)
        with torch.inference_mode():
            out.append(model.compute_logits(model(torch.tensor(prompt[start:end]), pos, kv,
                                                  meta)))
    return torch.cat(out)
