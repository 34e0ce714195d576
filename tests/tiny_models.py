"""Small random HF models and HF reference outputs, shared by tests (importable: tests/ is on
pytest's pythonpath)."""

from __future__ import annotations

import torch

TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=256, max_position_embeddings=512)


def make_tiny_model(path: str, arch: str, seed: int = 0, **overrides: object) -> str:
    """Saves a random `arch` model (llama | llama3 | mistral | qwen2 | qwen3 | qwen3_moe |
    mixtral) with safetensors; returns path."""
    import transformers as tf

    cls = {"llama": (tf.LlamaConfig, tf.LlamaForCausalLM),
           "llama3": (tf.LlamaConfig, tf.LlamaForCausalLM),
           "mistral": (tf.MistralConfig, tf.MistralForCausalLM),
           "qwen2": (tf.Qwen2Config, tf.Qwen2ForCausalLM),
           "qwen3": (tf.Qwen3Config, tf.Qwen3ForCausalLM),
           "qwen3_moe": (tf.Qwen3MoeConfig, tf.Qwen3MoeForCausalLM),
           "mixtral": (tf.MixtralConfig, tf.MixtralForCausalLM)}[arch]
    # A wide init makes logits peaked, so greedy argmax is far from ties and a 1-ulp
    # difference between two correct implementations cannot flip a token.
    kw: dict[str, object] = dict(TINY, initializer_range=0.3, tie_word_embeddings=False,
                                 bos_token_id=1, eos_token_id=2, pad_token_id=0)
    if arch == "qwen3":
        kw["head_dim"] = 32
    if arch == "llama3":  # Llama 3.1's long-context rope frequency scaling
        kw["rope_scaling"] = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                              "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
        kw["rope_theta"] = 500000.0
    if arch in ("mistral", "mixtral"):
        kw["sliding_window"] = None
    if arch == "qwen3_moe":  # 3 layers: 0 dense (mlp_only_layers), 1 and 2 MoE
        kw.update(head_dim=32, num_hidden_layers=3, num_experts=8, num_experts_per_tok=2,
                  moe_intermediate_size=48, norm_topk_prob=True, mlp_only_layers=[0])
    if arch == "mixtral":
        kw.update(num_local_experts=4, num_experts_per_tok=2, intermediate_size=96)
    kw.update(overrides)
    cfg = cls[0](**kw)
    torch.manual_seed(seed)
    model = cls[1](cfg).eval()
    model.save_pretrained(path, safe_serialization=True)
    return path


def hf_greedy(model_dir: str, prompt: list[int], n: int) -> list[int]:
    """HF transformers' greedy continuation, EOS ignored."""
    import transformers as tf

    hf = _hf_cache.get(model_dir)
    if hf is None:
        hf = _hf_cache[model_dir] = tf.AutoModelForCausalLM.from_pretrained(model_dir).eval()
    out = hf.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False,
                      eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


_hf_cache: dict[str, object] = {}

PROMPTS = [[5, 17, 33, 90, 12, 7, 8, 3, 100, 200, 44], [9, 9, 9, 1, 4], list(range(10, 60)),
           [250, 3, 77, 31, 31, 31, 8, 120, 64, 64, 64, 64, 19, 22, 200, 201, 17]]


def byte_tokenizer(path: str) -> None:
    """Writes a 256-token byte-level tokenizer.json into a model dir: the router needs one
    to serve the model."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tk = Tokenizer(models.BPE(vocab={ch: i for i, ch in enumerate(alphabet)}, merges=[]))
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    tk.save(f"{path}/tokenizer.json")
