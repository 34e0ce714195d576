"""Split-K projections whose reduce is fused into the next RMSNorm.

At one to a few rows a projection like o_proj or down_proj is a matrix-vector product, and
cuBLAS runs it split along K with a separate reduce kernel (two launches, and the gap
between them, per projection). When the projection's output only feeds a residual add and
an RMSNorm, which already reads every element once, the GEMM can instead leave its K-split
float32 partial sums as a strided batched product, and the norm kernel sums them
(kernels/triton_norm.rms_norm with [S, T, H] input). Only on CUDA and one rank: a TP rank's
row-parallel output is all-reduced first.
"""

from __future__ import annotations

import torch

# Up to this many rows the fused-reduce form is used (0 turns it off); beyond it the GEMM
# is compute-shaped and cuBLAS's own choice wins. Tuned on an H200 with
# bench/linear_split_probe.py.
MAX_ROWS = 4
# Partial sums per projection. Two measured best for Llama-3-8B's o_proj and down_proj
# alone (bench/fusion_probe.py: more partials made cuBLAS pick slower batched kernels).
SPLITS = 2


def splits_for(k: int) -> int:
    """The K-split count for an input of k features (1: no split)."""
    return SPLITS if SPLITS > 1 and k % SPLITS == 0 else 1


def split_k_linear(x: torch.Tensor, layer: torch.nn.Linear) -> torch.Tensor | None:
    """[S, T, N] float32 partials of layer(x) for x [T, K], or None where the fused form
    does not apply (the caller then runs the layer)."""
    t, k = x.shape
    s = splits_for(k)
    if (not x.is_cuda or t == 0 or t > MAX_ROWS or s == 1 or layer.bias is not None
            or not x.is_contiguous() or not layer.weight.is_contiguous()):
        return None
    n, c = layer.weight.shape[0], k // s
    # x [T, S, c] -> [S, T, c]; W [N, S, c] -> [S, c, N]: strided views, no copies.
    return torch.bmm(x.view(t, s, c).transpose(0, 1),
                     layer.weight.view(n, s, c).permute(1, 2, 0), out_dtype=torch.float32)
