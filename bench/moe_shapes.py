"""The model shapes bench/moe_bench.py measures (dummy weights from these HF configs), and
a shape's config as a run asks for it (--layers, --quantization fp8-block)."""

from __future__ import annotations

from typing import Any

QWEN3_30B_A3B = {
    "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
    "hidden_size": 2048, "intermediate_size": 6144, "moe_intermediate_size": 768,
    "num_hidden_layers": 48, "num_attention_heads": 32, "num_key_value_heads": 4,
    "head_dim": 128, "num_experts": 128, "num_experts_per_tok": 8, "norm_topk_prob": True,
    "decoder_sparse_step": 1, "mlp_only_layers": [], "vocab_size": 151936,
    "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "max_position_embeddings": 40960,
    "tie_word_embeddings": False, "use_sliding_window": False, "hidden_act": "silu",
    "bos_token_id": 151643, "eos_token_id": 151645, "torch_dtype": "bfloat16",
}

DEEPSEEK_V2_LITE = {
    "architectures": ["DeepseekV2ForCausalLM"], "model_type": "deepseek_v2",
    "hidden_size": 2048, "intermediate_size": 10944, "num_hidden_layers": 27,
    "num_attention_heads": 16, "num_key_value_heads": 16, "vocab_size": 102400,
    "max_position_embeddings": 163840, "kv_lora_rank": 512, "q_lora_rank": None,
    "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
    "first_k_dense_replace": 1, "moe_layer_freq": 1, "n_routed_experts": 64,
    "n_shared_experts": 2, "num_experts_per_tok": 6, "n_group": 1, "topk_group": 1,
    "topk_method": "greedy", "scoring_func": "softmax", "norm_topk_prob": False,
    "routed_scaling_factor": 1.0, "moe_intermediate_size": 1408, "hidden_act": "silu",
    "rms_norm_eps": 1e-6, "rope_theta": 10000, "attention_bias": False,
    "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 0.707,
                     "mscale_all_dim": 0.707, "original_max_position_embeddings": 4096,
                     "type": "yarn"},
    "tie_word_embeddings": False, "bos_token_id": 100000, "eos_token_id": 100001,
    "torch_dtype": "bfloat16",
}
MIXTRAL_8X7B = {
    "architectures": ["MixtralForCausalLM"], "model_type": "mixtral",
    "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
    "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
    "num_local_experts": 8, "num_experts_per_tok": 2, "vocab_size": 32000,
    "rms_norm_eps": 1e-5, "rope_theta": 1000000.0, "max_position_embeddings": 32768,
    "sliding_window": None, "tie_word_embeddings": False, "hidden_act": "silu",
    "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "bfloat16",
}
SHAPES = {"qwen3": ("Qwen3-30B-A3B shape, dummy", QWEN3_30B_A3B),
          "v2lite": ("DeepSeek-V2-Lite shape, dummy", DEEPSEEK_V2_LITE),
          "mixtral": ("Mixtral-8x7B shape, dummy", MIXTRAL_8X7B)}


def shape_config(shape: str, layers: int | None = None, quantization: str | None = None
                 ) -> tuple[str, dict[str, Any]]:
    """(label, HF config) of a --shape: its layer count replaced by `layers` (None: the
    model's), and fp8-block's quantization_config where asked. ValueError where `layers`
    leaves the shape no MoE layer (V2-Lite's first layer is dense): the bench measures
    those."""
    from engine.config import ModelConfig

    label, hf_config = SHAPES[shape]
    if layers is not None:
        hf_config = {**hf_config, "num_hidden_layers": layers}
        moe = ModelConfig.from_hf(hf_config).moe
        if layers < 1 or moe is None or not moe.layers:
            raise ValueError(f"--layers: {layers} leaves the {shape} shape no MoE layer")
        label = f"{label}, {layers} layers"
    if quantization == "fp8-block":
        hf_config = {**hf_config, "quantization_config": {
            "quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
            "weight_block_size": [128, 128]}}
    return label, hf_config
