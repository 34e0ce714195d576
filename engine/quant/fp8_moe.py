"""FP8 routed experts: a MoE layer's stacked w13 [El, 2I, H] and w2 [El, H, I] held as
float8_e4m3fn with float32 per-row scales w13_scale [El, 2I, G13] and w2_scale [El, H, G2],
which the fused MoE kernel applies in its GEMMs (kernels/triton_moe.py; weight-only: the
activations stay in the model's dtype, and decode reads one byte per expert weight).

G = 1: one scale per output channel (``--quantization fp8``, compressed-tensors channel
or tensor scales). G = ceil(K / bk): a block-scaled checkpoint's [ceil(N/bn), ceil(K/bk)]
scales, each row holding its block's (the form Fp8Linear holds). Experts are sharded
whole over ranks, so a rank's scales are its experts' and nothing is cut.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch
from torch import nn

from engine.models.moe import MoE
from engine.quant.fp8_linear import rows_scale
from engine.quant.scheme import Fp8Scheme
from engine.quant.weight_scale import mse_channel_quantize
from kernels import ref_fp8


def _moes(model: nn.Module) -> Iterator[tuple[str, MoE]]:
    for name, mod in model.named_modules():
        if isinstance(mod, MoE):
            yield name, mod


def quantized(scheme: Fp8Scheme, path: str) -> bool:
    """Whether the checkpoint quantized the experts of MoE module `path` (our name, e.g.
    "layers.1.mlp.experts"): not when `ignore` names them (all or none: one stack)."""
    names = [f"model.{path}", f"model.{path}.0.gate_proj", f"model.{path}.0.down_proj"]
    return not any(scheme.ignored(n) for n in names)


def groups(k: int, scheme: Fp8Scheme) -> int:
    """Scale groups per row of an expert weight with K = k input columns."""
    if scheme.weight != "block" or scheme.block is None:
        return 1
    bk = scheme.block[1]
    g = -(-k // bk)
    if k % bk and g > 1:
        raise ValueError(f"quantization_config.weight_block_size: {bk} does not divide the "
                         f"experts' input width {k}")
    return g


def _param(t: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(t, requires_grad=False)


def install_empty_experts(model: nn.Module, scheme: Fp8Scheme) -> int:
    """Makes each quantized MoE layer's stacks FP8 (and its scales ones) for the loader
    to fill; returns how many layers."""
    count = 0
    for path, moe in list(_moes(model)):
        if not quantized(scheme, path):
            continue
        dev = moe.w13.device
        for attr in ("w13", "w2"):
            w = getattr(moe, attr)
            e, n, k = w.shape
            setattr(moe, attr, _param(torch.empty(e, n, k, dtype=ref_fp8.FP8, device=dev)))
            setattr(moe, f"{attr}_scale", _param(torch.ones(e, n, groups(k, scheme),
                                                            dtype=torch.float32, device=dev)))
        count += 1
    return count


def quantize_experts(model: nn.Module, scheme: Fp8Scheme) -> int:
    """Replaces each MoE layer's float stacks by their FP8 quantization (per output
    channel, or the scheme's blocks), freeing the float stack as it goes; returns how
    many layers."""
    block = scheme.block if scheme.weight == "block" else None
    count = 0
    for path, moe in list(_moes(model)):
        if not quantized(scheme, path):
            continue
        for attr in ("w13", "w2"):
            w = getattr(moe, attr).data
            groups(w.shape[2], scheme)  # refuses a block width that does not divide K
            if block is None and scheme.weight_scales == "mse":
                q, s = _mse_stack(w)
            else:
                q, s = ref_fp8.quantize_stack(w, block)
            setattr(moe, attr, _param(q))
            setattr(moe, f"{attr}_scale", _param(s))
            del w
        count += 1
    return count


def _mse_stack(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[E, N, K] stacks with each expert's rows scaled as dense layers are at load
    (engine/quant/weight_scale.py), one expert at a time."""
    q = torch.empty(w.shape, dtype=ref_fp8.FP8, device=w.device)
    s = torch.empty(w.shape[0], w.shape[1], 1, dtype=torch.float32, device=w.device)
    for j in range(w.shape[0]):
        q[j], s[j] = mse_channel_quantize(w[j])
    return q, s


def scale_reader(scheme: Fp8Scheme, name: str
                 ) -> Callable[[torch.Tensor, tuple[int, int]], torch.Tensor]:
    """How an expert's checkpoint scale (HF tensor `name`) becomes the per-row scales
    [N, G] of the rows it scales (MoE.load_expert's scale_of)."""
    def read(w: torch.Tensor, shape: tuple[int, int]) -> torch.Tensor:
        try:
            return rows_scale(w, shape, scheme)
        except ValueError as e:
            raise ValueError(f"model: {name}: {e}") from None
    return read
