"""Small random HF models saved to temp dirs, shared by the engine tests."""

from __future__ import annotations

import os

import pytest
import torch

TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=256, max_position_embeddings=512)


def make_tiny_model(path: str, arch: str, seed: int = 0, **overrides: object) -> str:
    """Saves a random `arch` model (llama | qwen2 | qwen3) with safetensors; returns path."""
    import transformers as tf

    cls = {"llama": (tf.LlamaConfig, tf.LlamaForCausalLM),
           "qwen2": (tf.Qwen2Config, tf.Qwen2ForCausalLM),
           "qwen3": (tf.Qwen3Config, tf.Qwen3ForCausalLM)}[arch]
    # A wide init makes logits peaked, so greedy argmax is far from ties and a 1-ulp
    # difference between two correct implementations cannot flip a token.
    kw: dict[str, object] = dict(TINY, initializer_range=0.3, tie_word_embeddings=False,
                                 bos_token_id=1, eos_token_id=2, pad_token_id=0)
    if arch == "qwen3":
        kw["head_dim"] = 32
    kw.update(overrides)
    cfg = cls[0](**kw)
    torch.manual_seed(seed)
    model = cls[1](cfg).eval()
    model.save_pretrained(path, safe_serialization=True)
    return path


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("tiny")
    return {a: make_tiny_model(os.path.join(root, a), a, seed=i)
            for i, a in enumerate(("llama", "qwen2", "qwen3"))}
