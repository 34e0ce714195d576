"""FP8 checkpoint tensors made float as they load, for the modules that compute in float:
MLA attention, shared experts and the dense MLPs of an FP8 DeepSeek checkpoint (whose
routed experts stay FP8, engine/quant/fp8_moe.py). A weight waits for its scale (or the
scale for its weight: checkpoint order is free), then the pair becomes one float tensor
under the weight's name."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

import torch

from engine.quant.checkpoint import is_scale
from engine.quant.fp8_linear import rows_scale
from engine.quant.fp8_moe import groups
from engine.quant.scheme import Fp8Scheme
from kernels import ref_fp8


def _base(name: str) -> str:
    return name.rsplit(".", 1)[0]


def dequantize(w: torch.Tensor, scale: torch.Tensor, scheme: Fp8Scheme, name: str
               ) -> torch.Tensor:
    """An FP8 weight [N, K] and its checkpoint scale -> float32 [N, K]."""
    if w.dim() != 2:
        raise ValueError(f"model: {name} is float8 with shape {tuple(w.shape)}; a 2-D "
                         "weight was expected")
    n, k = w.shape
    try:
        rows = rows_scale(scale, (n, groups(k, scheme)), scheme)
    except ValueError as e:
        raise ValueError(f"model: {_base(name)}: {e}") from None
    return ref_fp8.dequant(w, rows)


def dequantized(weights: Iterable[tuple[str, torch.Tensor]], scheme: Fp8Scheme,
                keep: Callable[[str], bool]) -> Iterator[tuple[str, torch.Tensor]]:
    """`weights` with each FP8 ``<m>.weight`` and its ``<m>.weight_scale(_inv)`` replaced
    by the float ``<m>.weight``, except tensors `keep` names (passed as they are);
    ``input_scale`` tensors of the dequantized modules are dropped (they compute in float).
    A weight without its scale, or a scale without its weight, is refused at the end."""
    fp8: dict[str, torch.Tensor] = {}
    scales: dict[str, tuple[str, torch.Tensor]] = {}
    for name, w in weights:
        if keep(name):
            yield name, w
            continue
        if name.endswith(".input_scale"):
            continue
        if is_scale(name):
            base = _base(name)
            if base in fp8:
                yield f"{base}.weight", dequantize(fp8.pop(base), w, scheme, name)
            else:
                scales[base] = (name, w)
            continue
        if name.endswith(".weight") and w.dtype == ref_fp8.FP8:
            base = _base(name)
            if base in scales:
                sname, s = scales.pop(base)
                yield name, dequantize(w, s, scheme, sname)
            else:
                fp8[base] = w
            continue
        yield name, w
    if fp8:
        raise ValueError(f"model: {sorted(fp8)[0]}.weight is float8 and the checkpoint has "
                         f"no {scheme.scale_name or 'weight_scale'} for it")
    if scales:
        name = sorted(n for n, _ in scales.values())[0]
        raise ValueError(f"model: {name} scales a weight the checkpoint does not hold in "
                         "float8")
