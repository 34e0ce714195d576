"""Triton router logits for few tokens: logits = x @ w^T in float32, x widened in registers.

DeepSeek's router is a float32 linear whatever the model's dtype (HF: ``F.linear(
hidden.float(), weight.float())``), which torch runs at decode as three kernels per MoE
layer: the cast of x to float32 and cuBLAS's float32 GEMV as a dot kernel plus its
reduction (~6 µs a layer on an H200 at one token, bench/RESULTS.md's V2-Lite decode
profile). Here it is one dot-free kernel: each program owns BLOCK_E experts and one token,
streams their float32 (or bf16) rows across H and sums products in float32. The weight is
small (E x H, 512 KB at V2-Lite's 64 x 2048 in float32) and read once per token from L2
after the first. ``out_dtype`` is float32 for a float32 router; a router in the model's
dtype rounds its logits to that dtype, as its linear does.

Reference: kernels.ref_moe.router_logits_ref. Summation order differs from cuBLAS's, so
logits can differ in the last bits (the routing's ties are broken the same way).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.pdl import follow, pdl_for
from kernels.triton_common import check, check_device, check_float

BLOCK_E = 8  # experts per program: 8 programs a token at 64 experts, 32 at 256
BLOCK_K = 256


@triton.jit
def store_logits(x_ptr, w_ptr, out_ptr, E, H, s_x, s_w, s_o, pid_e, t,
                 BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr):
    """Token t's logits of experts [pid_e * BLOCK_E, (pid_e + 1) * BLOCK_E), stored in
    out's dtype: one program's work, here and in kernels/triton_router_route.py's fused
    kernel (Triton inlines it into both)."""
    es = pid_e * BLOCK_E + tl.arange(0, BLOCK_E)
    emask = es < E
    ks = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_E, BLOCK_K], dtype=tl.float32)
    w_rows = w_ptr + tl.where(emask, es, 0)[:, None].to(tl.int64) * s_w
    for k0 in range(0, H, BLOCK_K):
        if EVEN_K:
            w = tl.load(w_rows + k0 + ks[None, :])
            x = tl.load(x_ptr + t * s_x + k0 + ks)
        else:
            kmask = k0 + ks < H
            w = tl.load(w_rows + k0 + ks[None, :], mask=kmask[None, :], other=0.0)
            x = tl.load(x_ptr + t * s_x + k0 + ks, mask=kmask, other=0.0)
        acc += w.to(tl.float32) * x.to(tl.float32)[None, :]
    logits = tl.sum(acc, axis=1)
    tl.store(out_ptr + t * s_o + es, logits.to(out_ptr.dtype.element_ty), mask=emask)


@triton.jit
def _router_logits_kernel(x_ptr, w_ptr, out_ptr, E, H, s_x, s_w, s_o,
                          BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr,
                          EVEN_K: tl.constexpr, PDL: tl.constexpr):
    if PDL:  # x is the kernel before's output (kernels/pdl.py)
        follow()
    store_logits(x_ptr, w_ptr, out_ptr, E, H, s_x, s_w, s_o, tl.program_id(0),
                 tl.program_id(1).to(tl.int64), BLOCK_E, BLOCK_K, EVEN_K)


def router_logits(x: torch.Tensor, w: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """x [T, H] (float), w [E, H] (float) -> [T, E] of out_dtype, computed in float32."""
    check_router_args(x, w)
    t, h = x.shape
    e = w.shape[0]
    out = torch.empty(t, e, dtype=out_dtype, device=x.device)
    if t == 0:
        return out
    pdl = pdl_for(x)
    _router_logits_kernel[(triton.cdiv(e, BLOCK_E), t)](
        x, w, out, e, h, x.stride(0), w.stride(0), out.stride(0), BLOCK_E=BLOCK_E,
        BLOCK_K=BLOCK_K, EVEN_K=h % BLOCK_K == 0, PDL=pdl, num_warps=4, launch_pdl=pdl)
    return out


def check_router_args(x: torch.Tensor, w: torch.Tensor) -> None:
    """router_logits's checks of x and w, which kernels/triton_router_route.py shares."""
    check(x.dim() == 2 and w.dim() == 2 and x.shape[1] == w.shape[1],
          f"x, w: expected [T, H] and [E, H], got {tuple(x.shape)} and {tuple(w.shape)}")
    check_float("x", x)
    check_float("w", w)
    check(x.stride(1) == 1 and w.stride(1) == 1, "x, w: rows must be contiguous")
    check_device(x, w)
