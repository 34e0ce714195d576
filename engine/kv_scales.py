"""The per-layer scales of a float8 KV cache (``--kv-cache-dtype fp8``), and where they live.

A float8_e4m3fn entry holds ``x / scale`` (kernels/kv_fp8.py); each layer has one scale for
K and one for V (an MLA latent uses the K one). They come from the checkpoint when it has
them, as vLLM's and llm-compressor's FP8 checkpoints write them: per layer
``model.layers.N.self_attn.k_scale`` and ``.v_scale`` (scalars), or one ``.kv_scale`` for
both. Otherwise they are 1.0: e4m3 spans +-448 with 3 mantissa bits at every magnitude
from 2^-6 up, and K/V activations of the models served (post-norm, post-RoPE) lie well
inside that range, so a unit scale loses nothing to overflow and keeps e4m3's relative
precision; a scale computed from one prompt's activations would be no better for the
next one. The scales are fixed for the engine's life (they are part of the KV layout's
fingerprint, and captured graphs hold them as constants).
"""

from __future__ import annotations

import glob
import math
import os
import re
from typing import Any

import torch

from engine.config import EngineConfig, ModelConfig

_NAME = re.compile(r"^(?:model\.)?layers\.(\d+)\.self_attn\.(k_scale|v_scale|kv_scale)$")


def is_kv_scale(name: str) -> bool:
    """A checkpoint tensor that is a KV cache scale (not a weight)."""
    return _NAME.match(name) is not None


def checkpoint_kv_scales(path: str, num_layers: int) -> tuple[float, ...] | None:
    """[k0, v0, k1, v1, ...] from a safetensors directory; None when it has no KV scales.
    ValueError naming the tensor when some layer lacks one or one is not a positive
    finite scalar."""
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        return None
    from safetensors import safe_open

    found: dict[tuple[int, int], float] = {}
    for f in files:
        with safe_open(f, framework="pt") as st:
            for name in st.keys():  # noqa: SIM118 - safe_open is not a mapping
                m = _NAME.match(name)
                if m is None:
                    continue
                layer, kind = int(m.group(1)), m.group(2)
                t = st.get_tensor(name)
                if t.numel() != 1:
                    raise ValueError(f"model: {name}: a KV scale must be one value, got shape "
                                     f"{tuple(t.shape)}")
                value = float(t.float().item())
                if not (math.isfinite(value) and value > 0) or layer >= num_layers:
                    raise ValueError(f"model: {name}: {value!r} is not a positive finite "
                                     f"scale of one of {num_layers} layers")
                for plane in ((0, 1) if kind == "kv_scale" else (0 if kind == "k_scale" else 1,)):
                    found[(layer, plane)] = value
    if not found:
        return None
    missing = [f"layers.{i}.self_attn.{'kv'[p]}_scale" for i in range(num_layers)
               for p in (0, 1) if (i, p) not in found]
    if missing:
        raise ValueError(f"model: checkpoint has KV scales but lacks {missing[:4]}")
    return tuple(found[(i, p)] for i in range(num_layers) for p in (0, 1))


def kv_scales_for(config: EngineConfig, model_cfg: ModelConfig,
                  path: str | None) -> tuple[float, ...]:
    """The engine's KV scales: () for a float pool; for fp8 the checkpoint's, else 1.0."""
    if config.kv_cache_dtype != "fp8":
        return ()
    if path and os.path.isdir(path) and config.load_format != "dummy":
        found = checkpoint_kv_scales(path, model_cfg.num_layers)
        if found is not None:
            return found
    return (1.0,) * (2 * model_cfg.num_layers)


def apply_kv_scales(model: torch.nn.Module, scales: tuple[float, ...]) -> None:
    """Hands each layer's attention its scales (a float pool: nothing to do)."""
    if not scales:
        return
    layers: Any = model.layers
    assert len(scales) == 2 * len(layers), "one K and one V scale per layer"
    for i, layer in enumerate(layers):
        attn = layer.self_attn
        if hasattr(attn, "attn"):  # dense: its PagedAttention
            attn.attn.k_scale, attn.attn.v_scale = scales[2 * i], scales[2 * i + 1]
        else:  # MLA: the latent is one plane, read as key and value
            attn.kv_scale = scales[2 * i]


def kv_scales_of(model: torch.nn.Module) -> tuple[float, ...]:
    """The scales ``apply_kv_scales`` gave the model (for its TP followers)."""
    out: list[float] = []
    layers: Any = model.layers
    for layer in layers:
        attn = layer.self_attn
        if hasattr(attn, "attn"):
            out += [attn.attn.k_scale, attn.attn.v_scale]
        else:
            out += [attn.kv_scale, attn.kv_scale]
    return tuple(out)
