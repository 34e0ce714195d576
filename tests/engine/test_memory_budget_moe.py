"""The KV pool's activation estimate (engine/memory_budget.activation_bytes) covers a MoE
prefill step's expert rows in either form fused_moe may take: the Triton kernels' rows
per pair, and the grouped-GEMM form's peak (kernels/moe_grouped_gemm.py: the gathered rows
and gate/up at once, each expert's run padded to 16 rows). Mixtral's experts are wider
than its hidden size, where the grouped form's rows are the larger."""

from __future__ import annotations

import dataclasses

import pytest

from engine.config import ModelConfig, MoEConfig


def _cfg(hidden: int, inter: int, experts: int, top_k: int) -> ModelConfig:
    moe = MoEConfig(num_experts=experts, top_k=top_k, intermediate_size=inter,
                    layers=(0,), renormalize=True)
    return ModelConfig(arch="qwen3_moe", hidden_size=hidden, intermediate_size=4 * hidden,
                       num_layers=1, num_heads=16, num_kv_heads=4, head_dim=128,
                       vocab_size=32000, rms_norm_eps=1e-6, rope_theta=1e6,
                       max_position_embeddings=8192, tie_word_embeddings=False,
                       attention_bias=False, qk_norm=True, moe=moe)


@pytest.mark.parametrize("hidden,inter,experts,top_k", [
    (2048, 1408, 64, 6),  # DeepSeek-V2-Lite's routed experts
    (2048, 768, 128, 8),  # Qwen3-30B-A3B
    (4096, 14336, 8, 2),  # Mixtral-8x7B: I > H
])
@pytest.mark.parametrize("tokens", [1024, 4096])
def test_estimate_covers_both_expert_forms(hidden, inter, experts, top_k, tokens):
    from engine.memory_budget import activation_bytes
    from kernels.triton_moe_align import max_sorted_rows

    cfg = _cfg(hidden, inter, experts, top_k)
    dense = dataclasses.replace(cfg, moe=None)
    moe_part = activation_bytes(cfg, tokens, 0, 2) - activation_bytes(dense, tokens, 0, 2)
    pairs = tokens * top_k
    triton_rows = pairs * (inter * 2 + hidden * 2) + pairs * 8  # act and y rows, ids, weights
    rows = max_sorted_rows(pairs, experts, 16)
    grouped_peak = rows * (hidden + 2 * inter) * 2 + pairs * 4  # xs + gate_up, the row map
    assert moe_part >= triton_rows
    assert moe_part >= grouped_peak, (moe_part, grouped_peak)
