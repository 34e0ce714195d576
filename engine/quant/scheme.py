"""What an FP8 checkpoint (or ``--quantization fp8``) means for the linear layers.

Two checkpoint formats are read, and every field is checked: a value the engine does not
implement is refused, naming the field, never ignored.

* ``quant_method: "fp8"`` (transformers' FP8 format; DeepSeek-V3/R1, Qwen3-FP8):
  float8_e4m3fn weights, ``weight_block_size: [bn, bk]`` with ``weight_scale_inv`` of shape
  [ceil(N/bn), ceil(K/bk)] (a multiplier, despite the name), activations quantized per
  token in groups of bk at run time. Without ``weight_block_size``: one ``weight_scale``
  per tensor.
* ``quant_method: "compressed-tensors"`` (llm-compressor): one config group of float 8-bit
  symmetric weights, strategy ``tensor`` or ``channel`` (``weight_scale`` [1] or [N, 1]);
  activations ``token`` + dynamic, or ``tensor`` + static (``input_scale``), or none
  (weight-only).

``--quantization fp8`` on a bf16 checkpoint: per-channel weight scales, dynamic per-token
activations.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from typing import Any

# weight scales: "block" [ceil(N/bn), ceil(K/bk)], "channel" [N, 1], "tensor" [1]
WEIGHT_STRATEGIES = ("block", "channel", "tensor")
# activations: "token" (dynamic, per row; per row and K group for block weights),
# "tensor" (static input_scale), "none" (weight-only: x stays in the model's dtype)
ACT_STRATEGIES = ("token", "tensor", "none")


# Fewest decoder layers for which float_edge_layers applies (2 of 8 float: 25% of the
# projection bytes; 2 of 32, a Llama-3-8B's, 6%).
EDGE_MIN_LAYERS = 8


@dataclass(frozen=True)
class Fp8Scheme:
    weight: str  # a WEIGHT_STRATEGIES value
    act: str  # an ACT_STRATEGIES value
    block: tuple[int, int] | None = None  # (bn, bk) for weight == "block"
    # HF tensor suffix of the weight scale in the checkpoint ("weight_scale_inv" in the
    # fp8 format's block form); None: quantized at load from a bf16 checkpoint
    scale_name: str | None = "weight_scale"
    # Module names (HF, e.g. "model.layers.0.mlp.down_proj") left unquantized; entries
    # starting "re:" are regular expressions, as compressed-tensors writes them.
    ignore: tuple[str, ...] = ()
    # How weights quantized here (not read from a checkpoint) get their per-channel scales:
    # "amax" (largest weight on 448) or "mse" (the shrink of it with the least squared
    # error per row, engine/quant/weight_scale.py). Either way [N, 1] float32 multipliers.
    weight_scales: str = "amax"
    # Decoder layers at each end left unquantized when quantizing here (their names join
    # `ignore` once the layer count is known: with_edge_layers_ignored).
    float_edge_layers: int = 0

    @property
    def from_checkpoint(self) -> bool:
        return self.scale_name is not None

    def with_edge_layers_ignored(self, num_layers: int) -> Fp8Scheme:
        """This scheme with its first and last float_edge_layers decoder layers (of
        num_layers) added to `ignore`; unchanged for models under EDGE_MIN_LAYERS layers,
        where the float ends would be a quarter of the projections or more."""
        n = self.float_edge_layers
        if n <= 0 or num_layers < max(EDGE_MIN_LAYERS, 2 * n):
            return self
        edge = sorted(set(range(n)) | set(range(num_layers - n, num_layers)))
        pat = "re:(model\\.)?layers\\.(" + "|".join(map(str, edge)) + ")\\."
        return replace(self, ignore=(*self.ignore, pat), float_edge_layers=0)

    def ignored(self, module: str) -> bool:
        for pat in self.ignore:
            if pat.startswith("re:"):
                if re.match(pat[3:], module):
                    return True
            elif module == pat or module.removeprefix("model.") == pat.removeprefix("model."):
                return True
        return False


# --quantization fp8: per-channel weights with error-minimising scales, dynamic per-token
# activations, the first and last decoder layers left in the model's dtype (as FP8
# recipes leave sensitive layers out through `ignore`). On SmolLM2-135M in bf16
# (bench/RESULTS.md, FP8 accuracy) perplexity rose 4.2% with amax scales on every layer,
# 2.0% with searched scales, 1.0% with both ends float too; for a Llama-3-8B shape the
# two float layers add 0.44 GB (6% of the FP8 projection bytes). Checkpoints' dummy
# weights keep amax scales, which a real checkpoint's would be.
AT_LOAD = Fp8Scheme(weight="channel", act="token", scale_name=None, weight_scales="mse",
                    float_edge_layers=1)
# --quantization's values: "fp8-all" quantizes every decoder layer too, for an operator who
# wants the fewest bytes per step (the two float layers are ~6% of an 8B's projections).
AT_LOAD_SCHEMES = {"fp8": AT_LOAD, "fp8-all": replace(AT_LOAD, float_edge_layers=0)}
QUANTIZATION_FLAGS = tuple(AT_LOAD_SCHEMES)


def _refuse(field: str, why: str, value: Any) -> ValueError:
    return ValueError(f"quantization_config.{field}: {why}, got {value!r}")


def scheme_from_hf(cfg: dict[str, Any]) -> Fp8Scheme | None:
    """The scheme of an HF config.json's ``quantization_config``; None when there is none.
    It covers the dense projections and the routed experts (the fused MoE kernel reads
    FP8 experts); an MLA model's other FP8 tensors load dequantized."""
    q = cfg.get("quantization_config")
    if not q:
        return None
    if not isinstance(q, dict):
        raise _refuse("", "expected an object", q)
    method = q.get("quant_method")
    if method == "fp8":
        return _fp8_format(q)
    if method == "compressed-tensors":
        return _compressed_tensors(q)
    raise _refuse("quant_method", "only 'fp8' and 'compressed-tensors' (FP8) are implemented",
                  method)


def _fp8_format(q: dict[str, Any]) -> Fp8Scheme:
    fmt = q.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise _refuse("fmt", "only 'e4m3' (float8_e4m3fn) is implemented", fmt)
    act = q.get("activation_scheme", "dynamic")
    if act not in ("dynamic", "static"):
        raise _refuse("activation_scheme", "must be 'dynamic' or 'static'", act)
    ignore = tuple(q.get("modules_to_not_convert") or q.get("ignored_layers") or ())
    block = q.get("weight_block_size")
    if block is None:  # one scale per tensor (vLLM's serialized fp8)
        return Fp8Scheme(weight="tensor", act="token" if act == "dynamic" else "tensor",
                         ignore=ignore)
    if (not isinstance(block, list | tuple) or len(block) != 2
            or not all(isinstance(b, int) and b >= 16 and b & (b - 1) == 0 for b in block)):
        raise _refuse("weight_block_size", "must be two powers of two >= 16, e.g. [128, 128]",
                      block)
    if act != "dynamic":
        raise _refuse("activation_scheme", "block-wise weights need 'dynamic' activations",
                      act)
    return Fp8Scheme(weight="block", act="token", block=(block[0], block[1]),
                     scale_name="weight_scale_inv", ignore=ignore)


def _compressed_tensors(q: dict[str, Any]) -> Fp8Scheme:
    fmt = q.get("format", "float-quantized")
    if fmt not in ("float-quantized", "naive-quantized"):
        raise _refuse("format", "only 'float-quantized' (FP8) is implemented", fmt)
    if q.get("kv_cache_scheme"):
        raise _refuse("kv_cache_scheme", "KV-cache scales in the checkpoint are not "
                      "implemented", q.get("kv_cache_scheme"))
    groups = q.get("config_groups") or {}
    if not isinstance(groups, dict) or len(groups) != 1:
        raise _refuse("config_groups", "exactly one group is implemented",
                      list(groups) if isinstance(groups, dict) else groups)
    (gname, group), = groups.items()
    where = f"config_groups.{gname}"
    targets = group.get("targets") or []
    if targets != ["Linear"]:
        raise _refuse(f"{where}.targets", "only ['Linear'] is implemented", targets)
    if group.get("output_activations"):
        raise _refuse(f"{where}.output_activations", "output quantization is not "
                      "implemented", group.get("output_activations"))
    w = group.get("weights") or {}
    _check_fp8_args(f"{where}.weights", w)
    strategy = w.get("strategy")
    if strategy not in ("tensor", "channel"):
        raise _refuse(f"{where}.weights.strategy", "only 'tensor' and 'channel' are "
                      "implemented", strategy)
    if w.get("dynamic"):
        raise _refuse(f"{where}.weights.dynamic", "weights must be static", True)
    a = group.get("input_activations")
    if a is None:
        act = "none"
    else:
        _check_fp8_args(f"{where}.input_activations", a)
        astrat, dyn = a.get("strategy"), bool(a.get("dynamic"))
        if astrat == "token" and dyn:
            act = "token"
        elif astrat == "tensor" and not dyn:
            act = "tensor"
        elif astrat == "tensor" and dyn:
            act = "token"  # a finer dynamic scale than asked: never less accurate
        else:
            raise _refuse(f"{where}.input_activations", "implemented: strategy 'token' "
                          "dynamic, 'tensor' static or dynamic",
                          {"strategy": astrat, "dynamic": a.get("dynamic")})
    return Fp8Scheme(weight=strategy, act=act, ignore=tuple(q.get("ignore") or ()))


def _check_fp8_args(where: str, a: dict[str, Any]) -> None:
    if a.get("num_bits") != 8:
        raise _refuse(f"{where}.num_bits", "only 8 is implemented", a.get("num_bits"))
    if a.get("type") != "float":
        raise _refuse(f"{where}.type", "only 'float' (FP8) is implemented", a.get("type"))
    if a.get("symmetric", True) is not True:
        raise _refuse(f"{where}.symmetric", "only symmetric scales are implemented",
                      a.get("symmetric"))
    if a.get("group_size"):
        raise _refuse(f"{where}.group_size", "group scales are not implemented",
                      a.get("group_size"))
