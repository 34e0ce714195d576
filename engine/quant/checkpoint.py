"""How an FP8 checkpoint's scale tensors meet the loader: their names, a TP rank's cut of
them, and their copy into Fp8Linear's per-row form."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from engine.quant.fp8_linear import rows_scale
from engine.quant.scheme import Fp8Scheme

if TYPE_CHECKING:
    from engine.config import ModelConfig

SCALE_SUFFIXES = (".weight_scale_inv", ".weight_scale", ".input_scale")


def is_scale(name: str) -> bool:
    return name.endswith(SCALE_SUFFIXES)


def param_name(name: str) -> str:
    """The Fp8Linear parameter an HF tensor fills (``weight_scale_inv`` -> ``weight_scale``)."""
    return name[: -len("_inv")] if name.endswith(".weight_scale_inv") else name


def scale_cut(scheme: Fp8Scheme, name: str, weight_cut: tuple[int, int, int] | None,
              tp: int) -> tuple[int, int, int] | None:
    """A TP rank's (dim, start, stop) of scale tensor `name`, given its weight's cut."""
    if weight_cut is None or name.endswith(".input_scale") or scheme.weight == "tensor":
        return None
    dim, a, b = weight_cut
    if scheme.weight == "channel":  # [N, 1]: rows go with the weight's rows; K cuts none
        return weight_cut if dim == 0 else None
    assert scheme.block is not None
    size = scheme.block[dim]
    if a % size:
        raise ValueError(f"quantization_config.weight_block_size: {name}'s tensor-parallel "
                         f"cut starts at {a} along dim {dim}, inside a {size}-wide block "
                         f"(--tensor-parallel-size {tp})")
    return dim, a // size, -(-b // size)


def copy_scale(p: torch.Tensor, rows: tuple[int, int] | None, name: str, w: torch.Tensor,
               scheme: Fp8Scheme) -> None:
    """Copies scale `w` of HF tensor `name` into Fp8Linear parameter `p` (``rows`` of it
    for a fused projection's part)."""
    with torch.no_grad():
        if name.endswith(".input_scale"):
            if w.numel() != 1:
                raise ValueError(f"model: {name} has shape {tuple(w.shape)}; a static "
                                 "per-tensor input_scale has one value")
            p.copy_(torch.maximum(p, w.float().reshape(1).to(p.device)))
            return
        dst = p if rows is None else p.narrow(0, rows[0], rows[1])
        try:
            dst.copy_(rows_scale(w, dst.shape, scheme))
        except ValueError as e:
            raise ValueError(f"model: {name}: {e}") from None


def check_tp_cut(cfg: ModelConfig, size: int) -> None:
    """ValueError naming weight_block_size when some rank's cut of a projection would start
    inside a weight block (checked before any rank process starts)."""
    from engine.parallel.shards import hf_slice, shard_for

    scheme = cfg.quant
    if scheme is None or scheme.weight != "block" or size == 1 or cfg.is_mla:
        return  # MLA models read FP8 tensors whole and cut them dequantized
    for rank in range(size):
        shard = shard_for(cfg, rank, size)
        for proj in ("q_proj", "k_proj", "o_proj", "gate_proj", "down_proj"):
            name = f"model.layers.*.{proj}.weight_scale_inv"
            scale_cut(scheme, name, hf_slice(shard, name, cfg.head_dim), size)
