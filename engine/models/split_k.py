"""Split-K projections whose reduce is fused into the kernel that reads their output.

At one to a few rows a projection is a matrix-vector product; cuBLAS runs o_proj and
down_proj split along K with a separate reduce kernel (two launches, and the gap between
them), and qkv_proj unsplit at ~3.2 TB/s. Each of their outputs is read once by one small
kernel: o_proj's and down_proj's by the residual add + RMSNorm, qkv_proj's by RoPE + KV
store. So the GEMM leaves S float32 partial sums as a strided batched product, and that
kernel adds them (kernels/triton_norm.rms_norm with [S, T, H] input,
kernels/triton_rope_kv.rope_store_kv with [S, T, H, D] q/k/v). Only on CUDA and one rank:
a TP rank's row-parallel output is all-reduced first. On an H200, Llama-3-8B shape,
batch 1, a step took 4.636 -> 4.515 ms with o_proj + down_proj (one run), 4.526 -> 4.499 ms
adding qkv_proj (another run; bench/probes/fusion_probe.py, bench/RESULTS.md).
"""

from __future__ import annotations

import torch

from engine.quant import fp8_linear
from engine.quant.fp8_input import Fp8Input

# Up to this many rows the fused-reduce form is used (0 turns it off). Measured faster at
# 1, 2 and 4 rows (bench/probes/fusion_probe.py); more rows were not tried, and as the GEMM grows
# compute-shaped cuBLAS's own split choice should win.
MAX_ROWS = 4
# FP8 layers make their own partials (Fp8Linear.partials) up to the weight-only kernel's
# rows and, with per-channel scales, up to the K-split FP8 x FP8 kernel's
# (fp8_linear.SPLIT_GEMM_MAX_ROWS): otherwise a split sums in torch (a sum and a cast, two
# more launches; at 8 rows on an H200 those took 0.36 ms of a 8B model's step, bench/
# RESULTS.md, "Where the FP8 batch-1 decode step goes"). Read at each call, so a bench can
# set fp8_linear's limits.
def fp8_max_rows() -> int:
    # a narrow layer's limit is the largest any layer has
    return max(fp8_linear.WEIGHT_ONLY_MAX_ROWS,
               fp8_linear.split_gemm_max_rows(fp8_linear.NARROW_OUT))


# qkv_proj too (its partials summed by the RoPE + KV store kernel).
QKV = True
# ... for models with per-head q/k norms too (Qwen3's), whose norms the same kernel applies
# after the sum (kernels/triton_rope_kv.py's PARTS with NORM, tested with partials). Off:
# even on an H100 (session 36: 0.4% slower, within the spread), `bench/moe_bench.py
# --shape qwen3 --variants "engine.models.split_k.QK_NORM=True"`.
QK_NORM = False
# Partial sums per projection. Two measured best for Llama-3-8B's o_proj and down_proj
# alone (bench/probes/fusion_probe.py: more partials made cuBLAS pick slower batched kernels).
SPLITS = 2


def splits_for(k: int) -> int:
    """The K-split count for an input of k features (1: no split)."""
    return SPLITS if SPLITS > 1 and k % SPLITS == 0 else 1


def split_k_linear(x: torch.Tensor | Fp8Input, layer: torch.nn.Linear) -> torch.Tensor | None:
    """[S, T, N] float32 partials of layer(x) for x [T, K] (or x already quantized for an
    FP8 layer), or None where the fused form does not apply (the caller then runs the
    layer)."""
    if not x.is_cuda:
        # Before any attribute lookup: this runs for 3 projections of every layer in every
        # step, and on a float layer `layer.partials` misses, which nn.Module.__getattr__
        # answers by raising AttributeError (~2-3 µs each on the 2-core CPU box).
        return None
    # An FP8 layer makes its own (engine/quant). Looked up on the class: a method, and a
    # miss on the type costs no exception.
    if hasattr(type(layer), "partials"):
        if x.shape[0] == 0 or x.shape[0] > fp8_max_rows():
            return None
        out: torch.Tensor | None = type(layer).partials(layer, x)  # type: ignore[attr-defined]
        return out
    if isinstance(x, Fp8Input):  # only an FP8 layer is handed one
        return None
    t, k = x.shape
    s = splits_for(k)
    if (t == 0 or t > MAX_ROWS or s == 1 or layer.bias is not None
            or not x.is_contiguous() or not layer.weight.is_contiguous()):
        return None
    n, c = layer.weight.shape[0], k // s
    # x [T, S, c] -> [S, T, c]; W [N, S, c] -> [S, c, N]: strided views, no copies.
    return torch.bmm(x.view(t, s, c).transpose(0, 1),
                     layer.weight.view(n, s, c).permute(1, 2, 0), out_dtype=torch.float32)
