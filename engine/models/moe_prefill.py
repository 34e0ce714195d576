"""The MoE block's prefill-sized forms: the folded shared experts as dense GEMMs
(SparseMoeBlock at SHARED_DENSE_MIN_TOKENS tokens and up), and DeepSeek's float32 router
logits from a 16-bit tensor-core GEMM.

At a 4,096-token DeepSeek-V2-Lite prefill on an H100 (bench/results/moe_h100_s40/
v2_profile.json, `bench/moe_bench.py --shape v2lite --profile --batches 1 --contexts 512`)
these are, per MoE layer: the sum of the shared experts' [S, T, H] outputs 38 us and the
router's float32 GEMM (FFMA, no tensor cores, with its split-K reduce) 36 us, of ~1.85 ms;
the float32 cast of the hidden state is among the step's copies (14 us each, 54 of them).
Both switches are off until a GPU A/B (`bench/moe_bench.py --shape v2lite --batches ""
--prefill-variants "engine.models.moe_prefill.SHARED_DOWN_ONE_GEMM=True;engine.models.moe_prefill.
ROUTER_MM_MIN_TOKENS=1024"`).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

# The S shared experts' down projections as one GEMM over K = S x I: HF's own form
# (DeepSeek's shared MLP is one MLP of width S x I), rounded once. Off: S batched GEMMs,
# each expert's output rounded, then a sum kernel over them.
SHARED_DOWN_ONE_GEMM = False
# From this many tokens, float32 router logits from the 16-bit hidden state and a 16-bit copy
# of the router weight, multiplied on tensor cores with float32 accumulation and output
# (torch.mm's out_dtype). A 16-bit product is exact in float32, so this differs from the
# float32 GEMM only in the order of the float32 sums, which cuBLAS leaves open either way.
# Taken only where the weight round-trips through the model dtype exactly (a 16-bit
# checkpoint's router, which DeepSeek's are). None: the float32 GEMM at every size.
ROUTER_MM_MIN_TOKENS: int | None = None


def shared_dense(block: Any, x: torch.Tensor) -> torch.Tensor:
    """The folded shared experts of `block` (a SparseMoeBlock) on x [T, H] as dense GEMMs on
    their rows of the stack: one GEMM for every shared expert's gate and up ([T, S * 2I],
    expert s's [gate | up] columns), the activation on [T * S, 2I], then the down
    projections (SHARED_DOWN_ONE_GEMM: one GEMM on [T, S * I]; else S batched GEMMs and
    their sum)."""
    ex, s = block.experts, block.folded_shared
    e, i = ex.num_experts, ex.inter
    t, h = x.shape
    gate_up = F.linear(x, ex.w13[e:].reshape(s * 2 * i, h))  # [T, S * 2I]
    act = block.k.silu_and_mul(gate_up.view(t * s, 2 * i)).view(t, s, i)
    # (a graph's capture would record the weight's one-time copy: it takes the batched form)
    if s > 1 and SHARED_DOWN_ONE_GEMM and not (x.is_cuda
                                              and torch.cuda.is_current_stream_capturing()):
        return F.linear(act.view(t, s * i), _shared_down(block))
    down = torch.bmm(act.transpose(0, 1), ex.w2[e:].transpose(1, 2))  # [S, T, H]
    return down[0] if s == 1 else down.sum(0)


def _shared_down(block: Any) -> torch.Tensor:
    """The shared experts' down weights as HF holds them, [H, S * I] (expert s's columns at
    s * I), copied once from the stack's [S, H, I] rows on first use (S x H x I values a
    layer: 11.5 MB at DeepSeek-V2-Lite's shape)."""
    w = getattr(block, "_shared_down_hsi", None)
    if w is None:
        ex, s, e = block.experts, block.folded_shared, block.experts.num_experts
        h, i = ex.w2.shape[1], ex.w2.shape[2]
        w = ex.w2[e:].permute(1, 0, 2).reshape(h, s * i).contiguous()
        block._shared_down_hsi = w
    return w


def router_logits_fp32(block: Any, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [T, H] (the model's dtype), w [E, H] float32 -> float32 logits [T, E]."""
    # not while a CUDA graph captures: the weight's first use checks it on the host (a sync)
    if (ROUTER_MM_MIN_TOKENS is not None and x.shape[0] >= ROUTER_MM_MIN_TOKENS
            and x.is_cuda and x.dtype in (torch.bfloat16, torch.float16)
            and not torch.cuda.is_current_stream_capturing()):
        w16 = _router_weight(block, w, x.dtype)
        if w16 is not None:
            return torch.mm(x, w16.t(), out_dtype=torch.float32)
    return F.linear(x.float(), w.float())


def _router_weight(block: Any, w: torch.Tensor, dtype: torch.dtype) -> torch.Tensor | None:
    """The router weight in `dtype` when it converts exactly (else None), once per block."""
    cached = getattr(block, "_router_w16", None)
    if cached is not None and cached[0] is w and cached[1] == dtype:
        return cached[2]
    w16 = w.to(dtype)
    exact = bool(torch.equal(w16.float(), w.float()))
    block._router_w16 = (w, dtype, w16 if exact else None)
    return w16 if exact else None
