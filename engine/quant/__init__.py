"""Quantized linear layers: FP8 weights (block-wise, per-channel, per-tensor scales), read
from HF ``quantization_config`` or made from bf16 weights at load (``--quantization fp8``)."""
