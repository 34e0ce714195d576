"""engine.gguf_reader and engine.model_source against transformers' own GGUF loading.

Two sources: the embedded SmolLM2 GGUF (quantized, q/k permuted by llama.cpp) and tiny
random models written here the way llama.cpp's converter writes them.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
import transformers

from engine.gguf_reader import iter_gguf_tensors, read_gguf_config
from engine.model_source import model_display_name, resolve_model

# the reference reader; the GPU machine lacks it (the tests here need no GPU: CI runs them)
gguf = pytest.importorskip("gguf")


def llamacpp_permute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp's q/k row interleave: HF row (half p, index j) of a head -> row 2j + p."""
    half = w.shape[0] // n_heads // 2
    return w.reshape(n_heads, 2, half, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


_LAYER = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def gguf_name(hf: str) -> str:
    stem, _, suffix = hf.rpartition(".")
    if stem == "model.embed_tokens":
        return f"token_embd.{suffix}"
    if stem == "model.norm":
        return f"output_norm.{suffix}"
    if stem == "lm_head":
        return f"output.{suffix}"
    parts = stem.split(".", 3)  # model, layers, i, module
    return f"blk.{parts[2]}.{_LAYER[parts[3]]}.{suffix}"


def write_gguf(path: str, arch: str, cfg, state: dict[str, torch.Tensor]) -> None:
    """Write ``state`` (HF names, float32) as an F32 GGUF of architecture ``arch``."""
    w = gguf.GGUFWriter(path, arch)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    w.add_vocab_size(cfg.vocab_size)
    head_dim = getattr(cfg, "head_dim", cfg.hidden_size // cfg.num_attention_heads)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_dimension_count(head_dim)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    for name, t in state.items():
        a = t.detach().float().numpy()
        if arch == "llama" and ".q_proj." in name:
            a = llamacpp_permute(a, cfg.num_attention_heads)
        if arch == "llama" and ".k_proj." in name:
            a = llamacpp_permute(a, cfg.num_key_value_heads)
        w.add_tensor(gguf_name(name), np.ascontiguousarray(a))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.fixture(scope="module")
def embedded() -> str:
    return resolve_model(None)


def test_embedded_config(embedded: str) -> None:
    cfg = read_gguf_config(embedded)
    assert cfg["architectures"] == ["LlamaForCausalLM"] and cfg["model_type"] == "llama"
    assert (cfg["hidden_size"], cfg["intermediate_size"]) == (576, 1536)
    assert (cfg["num_attention_heads"], cfg["num_key_value_heads"]) == (9, 3)
    assert (cfg["num_hidden_layers"], cfg["head_dim"], cfg["vocab_size"]) == (30, 64, 49152)
    assert cfg["rope_theta"] == 100000.0 and cfg["max_position_embeddings"] == 8192
    assert cfg["tie_word_embeddings"] is True
    assert (cfg["bos_token_id"], cfg["eos_token_id"]) == (1, 2)
    assert abs(cfg["rms_norm_eps"] - 1e-5) < 1e-9


def test_embedded_tensors_equal_transformers(embedded: str, hf_smollm2) -> None:
    ref = hf_smollm2.state_dict()  # transformers' own load of the same file
    ours = dict(iter_gguf_tensors(embedded))
    # Tied: HF's state_dict shows lm_head as an alias of the embedding; we do not yield it.
    assert set(ref) - set(ours) == {"lm_head.weight"}
    assert set(ours) <= set(ref)
    for name, t in ours.items():
        assert t.dtype == torch.float32 and t.shape == ref[name].shape, name
        torch.testing.assert_close(t, ref[name], rtol=0, atol=0, msg=name)


def _tiny(arch: str):
    common = dict(
        vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
        rms_norm_eps=1e-6, tie_word_embeddings=False,
    )
    if arch == "llama":
        cfg = transformers.LlamaConfig(**common, rope_theta=5000.0)
        return cfg, transformers.LlamaForCausalLM(cfg)
    if arch == "qwen2":
        cfg = transformers.Qwen2Config(**common, rope_theta=5000.0)
        return cfg, transformers.Qwen2ForCausalLM(cfg)
    cfg = transformers.Qwen3Config(**common, head_dim=16, rope_theta=5000.0)
    return cfg, transformers.Qwen3ForCausalLM(cfg)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_tiny_roundtrip(arch: str, tmp_path) -> None:
    torch.manual_seed(0)
    cfg, model = _tiny(arch)
    state = {k: v for k, v in model.state_dict().items() if "rotary" not in k}
    for v in state.values():  # norms start at exactly 1.0; make them informative
        v.add_(torch.randn_like(v) * 0.1)
    path = str(tmp_path / f"tiny-{arch}.gguf")
    write_gguf(path, arch, cfg, state)

    ours = dict(iter_gguf_tensors(path))
    assert set(ours) == set(state)
    for name, t in ours.items():  # F32 file: the unpermute must be exact
        torch.testing.assert_close(t, state[name], rtol=0, atol=0, msg=name)

    c = read_gguf_config(path)
    assert c["model_type"] == arch and c["tie_word_embeddings"] is False
    assert c["head_dim"] == getattr(cfg, "head_dim", 8) and c["rope_theta"] == 5000.0
    assert (c["num_attention_heads"], c["num_key_value_heads"], c["vocab_size"]) == (4, 2, 64)

    if arch == "llama":  # transformers undoes the same permutation when it loads the file
        hf = transformers.AutoModelForCausalLM.from_pretrained(
            str(tmp_path), gguf_file=os.path.basename(path), dtype=torch.float32
        )
        for name, t in hf.state_dict().items():
            torch.testing.assert_close(ours[name], t, rtol=0, atol=0, msg=name)


def test_resolve_model(tmp_path, embedded: str) -> None:
    assert resolve_model("smollm2") == embedded and os.path.isabs(embedded)
    assert model_display_name(embedded) == "smollm2"
    with pytest.raises(ValueError, match="model: 'nope-model'.*tried path"):
        resolve_model("nope-model")
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ValueError, match="model: .*missing \\*.safetensors"):
        resolve_model(str(tmp_path))
    (tmp_path / "model.safetensors").write_bytes(b"")
    assert resolve_model(str(tmp_path)) == str(tmp_path)
    assert model_display_name(str(tmp_path)) == tmp_path.name
    other = tmp_path / "weights.bin"
    other.write_bytes(b"")
    with pytest.raises(ValueError, match="model: .*not a .gguf file"):
        resolve_model(str(other))
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"nope")
    with pytest.raises(ValueError, match="model: .*not a readable GGUF"):
        read_gguf_config(str(bad))
