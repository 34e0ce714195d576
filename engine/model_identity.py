"""What the KV layout fingerprint calls "the model": a digest of the model's content.

Two workers may only exchange KV computed by the same weights. A directory's name says
nothing about that (two fine-tunes saved as ``llama-3-8b`` on two nodes pair silently), so
the identity hashes the config and the weight files' bytes. Reading every byte of a 16 GB
checkpoint at start-up would cost tens of seconds per worker, so each weight file
contributes its size, its leading bytes (a safetensors header lists every tensor's name,
dtype, shape and offset; a GGUF header its metadata) and evenly spaced samples through the
rest: a fine-tune changes nearly every tensor, so sampled bytes differ too. Dummy weights
hash the config and the seed that generated them, and are marked so they never match a
real checkpoint of the same shape. Torch-free: the router can compute it too.
"""

from __future__ import annotations

import hashlib
import os

from engine.model_source import model_display_name

HEAD_BYTES = 1 << 20  # the file's header and first tensors
SAMPLES = 64  # evenly spaced reads through the rest of each file
SAMPLE_BYTES = 64 << 10  # 64 x 64 KiB = 4 MiB read per file at most, whatever its size


def _hash_file(h: hashlib._Hash, path: str) -> None:
    size = os.path.getsize(path)
    h.update(f"{os.path.basename(path)}|{size}|".encode())
    with open(path, "rb") as f:
        h.update(f.read(HEAD_BYTES))
        rest = size - HEAD_BYTES
        if rest <= 0:
            return
        if rest <= SAMPLES * SAMPLE_BYTES:
            h.update(f.read())
            return
        stride = rest // SAMPLES
        for i in range(SAMPLES):
            f.seek(HEAD_BYTES + i * stride)
            h.update(f.read(SAMPLE_BYTES))


def _weight_files(path: str) -> list[str]:
    if os.path.isfile(path):
        return [path]
    return sorted(os.path.join(path, n) for n in os.listdir(path)
                  if n.endswith(".safetensors"))


def _config_file(path: str) -> str | None:
    if os.path.isfile(path):
        return path if path.endswith(".json") else None  # a GGUF's config is in its header
    cfg = os.path.join(path, "config.json")
    return cfg if os.path.isfile(cfg) else None


def model_identity(path: str, load_format: str = "auto", seed: int = 0,
                   quantization: str | None = None) -> str:
    """``<display name>@<12 hex digits>``: equal for the same config and weights (wherever
    the files live), different for other weights, and never equal between dummy and real."""
    h = hashlib.sha256()
    cfg = _config_file(path)
    if cfg is not None:
        with open(cfg, "rb") as f:
            h.update(b"config|" + f.read())
    if quantization is not None:  # weights quantized at load are other weights
        h.update(f"quantization={quantization}|".encode())
    if load_format == "dummy":
        h.update(f"dummy|seed={seed}".encode())
    else:
        h.update(b"weights|")
        for w in _weight_files(path):
            _hash_file(h, w)
    name = model_display_name(path[: -len("/config.json")] if path.endswith("/config.json")
                              else path)
    tag = "dummy-" if load_format == "dummy" else ""
    return f"{tag}{name}@{h.hexdigest()[:12]}"
