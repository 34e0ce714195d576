"""An activation already quantized for an FP8 x FP8 projection, by the kernel that made it.

Above the weight-only rows (prefill, decode batches past fp8_linear.WEIGHT_ONLY_MAX_ROWS) an
FP8 projection with per-channel weights quantizes its input per row before the product: a
kernel that reads the whole input and writes it again at half the bytes. For the
projections that follow an RMSNorm (qkv_proj, gate_up_proj) or SiLU x mul (down_proj), that
kernel already holds each row, so it writes the FP8 row and its scale itself
(kernels/triton_norm.rms_norm_quant, kernels/triton_act.silu_and_mul_quant) and the layer
takes this pair instead (Fp8Linear.takes_fp8_input). The values are the same bytes the
separate quantizer would write from the rounded output (tests/kernels/test_fused_quant.py).
On an H200, that quantizer was 3.8 ms of an 8B model's 69 ms FP8 prefill of 4,096 tokens
(bench/fp8_bench.py --sections prefill_profile).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# The model code fuses the quantization where it can (False: the separate quantizer, for
# the benchmark's A/B).
FUSED = True


@dataclass(frozen=True)
class Fp8Input:
    """q [T, K] float8_e4m3fn and scale [T, 1] float32, x ~= q * scale; dtype is the
    activation's own (what the projection returns). Answers the few tensor questions the
    model code asks of a projection's input (shape, dtype, device)."""

    q: torch.Tensor
    scale: torch.Tensor
    dtype: torch.dtype

    @property
    def shape(self) -> torch.Size:
        return self.q.shape

    @property
    def is_cuda(self) -> bool:
        return self.q.is_cuda

    @property
    def device(self) -> torch.device:
        return self.q.device


def wants_fp8_input(layer: object, rows: int, kernel: object) -> bool:
    """Whether the kernel about to make `layer`'s input should quantize it for the layer:
    fusion on, a fused kernel in the model's kernel set (`kernel` not None), and `layer` an
    FP8 projection that quantizes `rows` rows per row itself."""
    if not FUSED or kernel is None:
        return False
    takes = getattr(type(layer), "takes_fp8_input", None)
    return takes is not None and bool(takes(layer, rows))
