"""GGUF files as an HF-style config dict and a stream of float32 tensors under HF names.

The model code only knows HF parameter names and ``config.json`` fields, so a GGUF is
translated at this seam. Two facts about llama.cpp's converter matter:

* Tensor shapes: GGUF lists dims innermost-first (``[in, out]``); the numpy array the
  reader exposes is already row-major ``[out, in]``, which is HF's Linear layout.
* For the ``llama`` architecture the converter permutes the rows of ``q_proj`` and
  ``k_proj`` inside each head so llama.cpp's rope can rotate adjacent pairs
  ``(2j, 2j+1)``, whereas HF rotates halves ``(j, j + d/2)``. We undo it (see
  ``unpermute_qk_rows``). Qwen2/Qwen3 files are written unpermuted (their HF models
  use rotate-half and llama.cpp runs them in "neox" rope mode).

Torch is imported only by ``iter_gguf_tensors``; reading the config stays torch-free.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    import gguf
    import torch

# GGUF architecture -> (HF architectures entry, HF model_type).
_ARCHES = {
    "llama": ("LlamaForCausalLM", "llama"),
    "qwen2": ("Qwen2ForCausalLM", "qwen2"),
    "qwen3": ("Qwen3ForCausalLM", "qwen3"),
}
# Architectures whose q/k rows llama.cpp's converter permuted for interleaved rope.
_PERMUTED_QK = {"llama"}

# GGUF per-layer tensor stem -> HF module path inside model.layers.{i}.
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",  # Qwen3's per-head RMSNorm on q
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
# Tensors llama.cpp stores that HF recomputes from the config (rope inverse frequencies).
_SKIPPED = {"rope_freqs"}


def open_gguf(path: str) -> gguf.GGUFReader:
    import gguf

    try:
        return gguf.GGUFReader(path)
    except Exception as e:  # the reader raises bare ValueError/struct errors on bad files
        raise ValueError(f"model: {path} is not a readable GGUF file: {e}") from e


def gguf_metadata(reader: gguf.GGUFReader, key: str, default: Any = None) -> Any:
    """A metadata value as a plain Python value (str, int, float, bool or list)."""
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def _arch(reader: gguf.GGUFReader, path: str) -> str:
    arch = gguf_metadata(reader, "general.architecture")
    if arch not in _ARCHES:
        raise ValueError(
            f"model: GGUF architecture {arch!r} in {path} is not supported "
            f"(supported: {', '.join(sorted(_ARCHES))})"
        )
    return str(arch)


def _config_from_reader(reader: gguf.GGUFReader, path: str) -> dict[str, Any]:
    arch = _arch(reader, path)

    def meta(key: str, default: Any = None) -> Any:
        return gguf_metadata(reader, f"{arch}.{key}", default)

    def required(key: str) -> Any:
        value = meta(key)
        if value is None:
            raise ValueError(f"model: GGUF {path} lacks metadata {arch}.{key}")
        return value

    hidden = int(required("embedding_length"))
    heads = int(required("attention.head_count"))
    kv_heads = int(meta("attention.head_count_kv", heads))
    # key_length is the explicit head size (Qwen3 sets it != hidden/heads); rope's
    # dimension_count equals it for full-rotary models, the only kind we load.
    head_dim = int(meta("attention.key_length", meta("rope.dimension_count", hidden // heads)))
    tensor_names = {t.name for t in reader.tensors}
    vocab = meta("vocab_size")
    if vocab is None:
        tokens = reader.fields.get("tokenizer.ggml.tokens")
        vocab = len(tokens.data) if tokens is not None else None
    if vocab is None:
        raise ValueError(f"model: GGUF {path} states no vocab size")
    hf_arch, model_type = _ARCHES[arch]
    config: dict[str, Any] = {
        "architectures": [hf_arch],
        "model_type": model_type,
        "hidden_size": hidden,
        "intermediate_size": int(required("feed_forward_length")),
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "num_hidden_layers": int(required("block_count")),
        "rms_norm_eps": float(meta("attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": float(meta("rope.freq_base", 10000.0)),
        "vocab_size": int(vocab),
        "max_position_embeddings": int(meta("context_length", 2048)),
        "head_dim": head_dim,
        # llama.cpp drops output.weight when the model ties it to the embedding.
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "bos_token_id": gguf_metadata(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": gguf_metadata(reader, "tokenizer.ggml.eos_token_id"),
        "hidden_act": "silu",
        "torch_dtype": "float32",
    }
    if arch == "qwen2":
        config["attention_bias"] = True
    scaling = meta("rope.scaling.type")
    if scaling == "linear":
        config["rope_scaling"] = {"type": "linear", "factor": float(meta("rope.scaling.factor"))}
    elif scaling not in (None, "none"):
        raise ValueError(f"model: GGUF {path} uses rope scaling {scaling!r}, not supported")
    return config


def read_gguf_config(path: str) -> dict[str, Any]:
    """An HF ``config.json``-style dict for the model in the GGUF file at ``path``."""
    return _config_from_reader(open_gguf(path), path)


def hf_tensor_name(gguf_name: str) -> str | None:
    """HF parameter name for a GGUF tensor name; None for tensors HF does not store."""
    stem, _, suffix = gguf_name.rpartition(".")  # suffix: "weight" or "bias"
    if stem in _SKIPPED:
        return None
    if stem in _GLOBAL_NAMES:
        return f"{_GLOBAL_NAMES[stem]}.{suffix}"
    parts = stem.split(".")
    if len(parts) == 3 and parts[0] == "blk" and parts[2] in _LAYER_NAMES:
        return f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}.{suffix}"
    raise ValueError(f"model: unknown GGUF tensor {gguf_name!r}")


def unpermute_qk_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's per-head row interleave of a q/k projection (weight or bias).

    Within one head of size d, HF row ``p * d/2 + j`` (half p in {0, 1}, j < d/2) was
    written to row ``2j + p``, so the rope pair (j, j + d/2) sits adjacent. Reading the
    head as [d/2, 2] and transposing to [2, d/2] puts each row back.
    """
    rows = w.shape[0]  # w: [n_heads * d, in] (weight) or [n_heads * d] (bias)
    half = rows // n_heads // 2
    return w.reshape(n_heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def iter_gguf_tensors(path: str) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(hf_name, tensor)`` for every weight, dequantized to float32 in HF shape."""
    import gguf
    import torch

    reader = open_gguf(path)
    config = _config_from_reader(reader, path)
    permuted = _arch(reader, path) in _PERMUTED_QK
    heads = {"attn_q": config["num_attention_heads"], "attn_k": config["num_key_value_heads"]}
    for t in reader.tensors:
        name = hf_tensor_name(t.name)
        if name is None:
            continue
        # t.data is a read-only memmap of raw blocks; dequantize gives float32 [out, in].
        w = gguf.quants.dequantize(t.data, t.tensor_type)
        w = w.reshape([int(d) for d in reversed(t.shape)])
        stem = t.name.split(".")[-2]
        if permuted and stem in heads:
            w = unpermute_qk_rows(w, heads[stem])
        # Own, writable float32 memory: torch must not alias the file mapping.
        yield name, torch.from_numpy(np.array(w, dtype=np.float32, copy=True))
