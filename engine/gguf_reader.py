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

import functools
import mmap
import os
import struct
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from engine.gguf_dequant import dequantize

if TYPE_CHECKING:
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


# GGUF metadata value types (spec: ggml/docs/gguf.md) -> struct format, little-endian.
_SCALAR = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?",
           10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9
_U64 = struct.Struct("<Q")
_MAGIC = b"GGUF"


@dataclass(frozen=True)
class GGUFTensorInfo:
    name: str
    shape: tuple[int, ...]  # row-major (outermost first): [out, in] for a matrix
    qtype: int  # ggml type id (gguf.GGMLQuantizationType value)
    offset: int  # absolute byte offset of the data in the file


class GGUFFile:
    """The header of a GGUF file: metadata and tensor index, over a read-only mmap.

    Our own parser rather than ``gguf.GGUFReader``: that one builds a numpy view per
    string, which takes seconds on a 49k-token vocabulary; the router's start-up reads
    this too and must stay well under a second.
    """

    def __init__(self, path: str) -> None:
        self.path = path
        try:
            with open(path, "rb") as f:
                self._mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
            self._pos = 0
            self.metadata, self.tensors = self._parse()
        except (OSError, ValueError, struct.error, UnicodeDecodeError) as e:
            raise ValueError(f"model: {path} is not a readable GGUF file: {e}") from e

    def _read(self, fmt: str) -> Any:
        (value,) = struct.unpack_from(fmt, self._mm, self._pos)
        self._pos += struct.calcsize(fmt)
        return value

    def _string(self) -> str:
        n = self._read("<Q")
        raw = self._mm[self._pos : self._pos + n]
        self._pos += n
        return raw.decode("utf-8")

    def _strings(self, n: int) -> list[str]:
        """An array of n strings (a vocabulary, its merges): one tight loop, since a
        49k-token vocabulary went through _value/_string/_read per string in 0.3 s."""
        mm, pos, out = self._mm, self._pos, []
        length = _U64.unpack_from
        for _ in range(n):
            k = length(mm, pos)[0]
            pos += 8
            out.append(mm[pos:pos + k].decode("utf-8"))
            pos += k
        self._pos = pos
        return out

    def _value(self, vtype: int) -> Any:
        if vtype == _STRING:
            return self._string()
        if vtype == _ARRAY:
            etype, n = self._read("<I"), self._read("<Q")
            if etype in _SCALAR:  # numeric arrays in one numpy read, not n unpacks
                dt = np.dtype(_SCALAR[etype].replace("?", "b1"))
                arr = np.frombuffer(self._mm, dtype=dt, count=n, offset=self._pos)
                self._pos += n * dt.itemsize
                return arr.tolist()
            if etype == _STRING:
                return self._strings(n)
            return [self._value(etype) for _ in range(n)]
        if vtype not in _SCALAR:
            raise ValueError(f"unknown metadata value type {vtype}")
        return self._read(_SCALAR[vtype])

    def _parse(self) -> tuple[dict[str, Any], list[GGUFTensorInfo]]:
        if self._mm[:4] != _MAGIC:
            raise ValueError("bad magic (not GGUF)")
        self._pos = 4
        version = self._read("<I")
        if version not in (2, 3):
            raise ValueError(f"unsupported GGUF version {version} (or big-endian file)")
        n_tensors, n_kv = self._read("<Q"), self._read("<Q")
        meta: dict[str, Any] = {}
        for _ in range(n_kv):
            key = self._string()
            meta[key] = self._value(self._read("<I"))
        raw = []
        for _ in range(n_tensors):
            name = self._string()
            dims = [self._read("<Q") for _ in range(self._read("<I"))]
            raw.append((name, tuple(reversed(dims)), self._read("<I"), self._read("<Q")))
        align = int(meta.get("general.alignment", 32))
        start = -(-self._pos // align) * align  # tensor data begins at the next aligned byte
        tensors = [GGUFTensorInfo(n, s, q, start + o) for n, s, q, o in raw]
        return meta, tensors

    def get(self, key: str, default: Any = None) -> Any:
        return self.metadata.get(key, default)

    def raw_tensor(self, info: GGUFTensorInfo) -> np.ndarray:
        """The tensor's bytes as uint8 ``[*outer, row_bytes]`` (the layout dequantize takes)."""
        import gguf

        block, type_bytes = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(info.qtype)]
        row_bytes = info.shape[-1] // block * type_bytes
        outer = int(np.prod(info.shape[:-1]))
        data = np.frombuffer(self._mm, np.uint8, count=outer * row_bytes, offset=info.offset)
        return data.reshape(*info.shape[:-1], row_bytes)


def open_gguf(path: str) -> GGUFFile:
    """The parsed header of ``path``, parsed once per process while the file is unchanged:
    an engine start reads it three times (config, weights, tokenizer)."""
    try:
        st = os.stat(path)
    except OSError as e:
        raise ValueError(f"model: {path} is not a readable GGUF file: {e}") from e
    return _open_unchanged(path, st.st_size, st.st_mtime_ns)


@functools.lru_cache(maxsize=4)
def _open_unchanged(path: str, size: int, mtime_ns: int) -> GGUFFile:
    return GGUFFile(path)


def _arch(reader: GGUFFile, path: str) -> str:
    arch = reader.get("general.architecture")
    if arch not in _ARCHES:
        raise ValueError(
            f"model: GGUF architecture {arch!r} in {path} is not supported "
            f"(supported: {', '.join(sorted(_ARCHES))})"
        )
    return str(arch)


def _config_from_reader(reader: GGUFFile, path: str) -> dict[str, Any]:
    arch = _arch(reader, path)

    def meta(key: str, default: Any = None) -> Any:
        return reader.get(f"{arch}.{key}", default)

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
    if vocab is None and "tokenizer.ggml.tokens" in reader.metadata:
        vocab = len(reader.metadata["tokenizer.ggml.tokens"])
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
        "bos_token_id": reader.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": reader.get("tokenizer.ggml.eos_token_id"),
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


def iter_gguf_tensors(path: str, slicer: Callable[[str], tuple[int, int, int] | None]
                      | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(hf_name, tensor)`` for every weight, dequantized to float32 in HF shape.

    slicer(hf_name) -> (dim, start, stop): only that part (a tensor-parallel rank's). Rows
    are quantized independently, so a row range is cut before dequantizing; a column range
    needs the whole tensor dequantized first."""
    import torch

    reader = open_gguf(path)
    config = _config_from_reader(reader, path)
    permuted = _arch(reader, path) in _PERMUTED_QK
    heads = {"attn_q": config["num_attention_heads"], "attn_k": config["num_key_value_heads"]}
    for t in reader.tensors:
        name = hf_tensor_name(t.name)
        if name is None:
            continue
        cut = slicer(name) if slicer is not None else None
        # raw: uint8 [out, row_bytes] over the mmap; dequantize gives float32 [out, in].
        raw = reader.raw_tensor(t)
        rows = raw.shape[0]
        early = cut is not None and cut[0] == 0 and raw.ndim == 2
        if early:
            assert cut is not None
            raw = raw[cut[1]:cut[2]]
        w = dequantize(raw, t.qtype)
        stem = t.name.split(".")[-2]
        if permuted and stem in heads:  # the interleave is within a head: whole heads cut
            w = unpermute_qk_rows(w, heads[stem] * w.shape[0] // rows if early
                                  else heads[stem])
        if cut is not None and not early:
            w = w[cut[1]:cut[2]] if cut[0] == 0 else w[:, cut[1]:cut[2]]
        # Writable float32 memory: torch must not alias the (read-only) file mapping; a
        # dequantized tensor already is new memory, copied only when a column cut left it
        # strided.
        yield name, torch.from_numpy(np.require(w, np.float32, ("C", "W")))
