"""Puts Fp8Linear layers (and FP8 expert stacks) into a built model: empty ones before an
FP8 checkpoint loads, or quantized copies of the loaded float layers (``--quantization
fp8``, dummy weights). MLA attention, shared experts, routers, embeddings and the head stay
float."""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import nn

from engine.quant.fp8_linear import Fp8Linear
from engine.quant.scheme import Fp8Scheme

# Our fused projection -> the HF modules it holds (a fused layer is quantized when its
# parts are; the checkpoint quantizes them alike or the load is refused).
FUSED_PARTS = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "o_proj": ("o_proj",),
               "gate_up_proj": ("gate_proj", "up_proj"), "down_proj": ("down_proj",)}


def _targets(model: nn.Module) -> Iterator[tuple[nn.Module, str, str]]:
    """(parent, attribute, full name) of each dense decoder projection: attention's qkv/o
    and the dense MLP's gate_up/down (not embeddings, lm_head, MoE experts or MLA)."""
    from engine.models.llama import MLP, Attention

    for name, mod in model.named_modules():
        if not isinstance(mod, Attention | MLP):
            continue
        for attr in FUSED_PARTS:
            if isinstance(getattr(mod, attr, None), nn.Linear):
                yield mod, attr, f"{name}.{attr}"


def _quantized(scheme: Fp8Scheme, full_name: str) -> bool:
    """Whether the checkpoint quantized the HF modules behind our fused `full_name`."""
    prefix, attr = full_name.rsplit(".", 1)
    parts = [f"model.{prefix}.{p}" for p in FUSED_PARTS[attr]]
    ignored = [scheme.ignored(p) for p in parts]
    if any(ignored) and not all(ignored):
        raise ValueError(f"quantization_config.ignore: {parts} are fused into one layer; "
                         "ignoring only some of them is not implemented")
    return not ignored[0]


def install_empty(model: nn.Module, scheme: Fp8Scheme) -> int:
    """Replaces each quantized projection by an empty Fp8Linear, and makes each quantized
    MoE layer's expert stacks FP8 (engine/quant/fp8_moe.py), for the loader to fill;
    returns how many projections and expert layers."""
    from engine.quant.fp8_moe import install_empty_experts

    count = install_empty_experts(model, scheme)
    cfg = getattr(model, "cfg", None)
    if cfg is not None and cfg.is_mla:
        return count  # the other FP8 tensors load dequantized (engine/quant/dequantize.py)
    for parent, attr, full in list(_targets(model)):
        if not _quantized(scheme, full):
            continue
        layer = getattr(parent, attr)
        w = layer.weight
        setattr(parent, attr, Fp8Linear(layer.in_features, layer.out_features,
                                        layer.bias is not None, scheme, device=w.device,
                                        dtype=w.dtype))
        count += 1
    return count


def quantize_loaded(model: nn.Module, scheme: Fp8Scheme) -> int:
    """Replaces each projection, and each MoE layer's expert stacks, by its FP8
    quantization (per-channel or block scales), freeing the float weight as it goes;
    returns how many projections and expert layers."""
    from engine.quant.fp8_moe import quantize_experts

    cfg = getattr(model, "cfg", None)
    if cfg is not None:
        scheme = scheme.with_edge_layers_ignored(cfg.num_layers)
    count = quantize_experts(model, scheme)
    for parent, attr, full in list(_targets(model)):
        if not _quantized(scheme, full):
            continue
        # only the parent holds the float layer: replacing it frees its weight, so the
        # peak is the float model plus one layer's FP8 copy
        setattr(parent, attr, Fp8Linear.from_float(getattr(parent, attr), scheme))
        count += 1
    if torch.cuda.is_available():
        torch.cuda.empty_cache()  # the float weights' blocks back to the device budget
    return count
