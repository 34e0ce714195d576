"""The router's logits and the top-k routing of a few tokens in one launch.

At decode each MoE layer ran kernels/triton_router_logits.py (BLOCK_E experts' logits of
one token per program) and then kernels/triton_moe_route.py (one program per token),
back to back. In a CUDA graph at batch 1 a launch costs a few microseconds however
little it does, so this kernel does both: its grid is the logits kernel's
(cdiv(E, BLOCK_E) x T), and the last of a token's programs to finish its logits routes
that token, the "last program done" pattern of CUDA's threadFenceReduction sample.

Memory ordering, per token t (every program runs the same steps):
1. it stores its experts' logits (in out_dtype, as router_logits does: a router in the
   model's dtype rounds them, and the routing reads the rounded values);
2. ``tl.debug_barrier()``: every thread of the program has made its stores (the
   increment below is one thread's);
3. ``atomic_add(count[t], 1)`` with acq_rel semantics at gpu scope. Its release half
   publishes this program's logits (the barrier put every thread's stores before it);
   its acquire half makes every program that incremented before visible to this one;
4. the program that read count == programs per token - 1 is the last: all the others
   released their logits before their increments, which it acquired. It resets
   count[t] to 0 and routes t, reading the logits from L2 (``.cg``: L1 is per SM and
   not coherent with other SMs' stores). Its other threads read after the acquire too:
   Triton hands the one thread's atomic result to all through shared memory behind a
   barrier (tests/kernels/test_router_route_sm90.py checks this order in the PTX).
No program waits for another, so there is no deadlock however the programs are
scheduled.

The counters: int32 zeros, one per token, one buffer per device shared by every layer
and every launch of this kernel (``counters``, kernels/last_program.py: why self-reset
makes that graph-safe and stream order makes it race-free).

PRENORM (``router_route_prenorm``): the layer's post-attention residual add + RMSNorm in
the same launch, one more launch saved per MoE layer at decode. Every program of token t
computes the whole normed row of t (H values, from the attention output and the
residual) with kernels/triton_norm.py's helpers, at _rms_norm_kernel's warps (so its
register layout and order of additions: rms_norm's bits), and stores it to normed[t];
program 0 of t stores the new residual. Then ``tl.debug_barrier()``, so that every
thread of the program sees its own program's stores, and the logits read the row back
from normed[t] as they read x above (store_logits streams it across H). The experts read
normed in the next kernel (stream order). The programs of t store to normed[t] at the
same time, but the same bytes: the same code on the same inputs, deterministic. So
whichever store a byte ends up from, and whichever a program's load sees (never earlier
than its own, after its barrier), it is the same value: the race is benign. A scratch
row per program would need a [T, E / BLOCK_E, H] buffer beside normed (which the experts
read) to avoid a race that changes nothing.

Reference: router_logits + moe_route (kernels/triton_router_logits.py,
kernels/triton_moe_route.py), whose results these are exactly: the same arithmetic, in
the same jit helpers; with PRENORM, rms_norm (kernels/triton_norm.py) before them.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# MIN_COUNTERS: the first launch's allocation, re-exported (what the engine's bound is held to)
from kernels.last_program import MIN_COUNTERS as MIN_COUNTERS
from kernels.last_program import CounterPool
from kernels.pdl import follow, pdl_for
from kernels.triton_common import check, check_device, check_float, check_shape
from kernels.triton_moe_route import route_constexprs, route_token
from kernels.triton_norm import add_residual, load_row, norm_warps, rms_norm_row
from kernels.triton_router_logits import BLOCK_E, BLOCK_K, check_router_args, store_logits

_POOL = CounterPool("router_route")
_COUNTERS = _POOL.buffers  # device -> [>= T] int32, all zero at rest
_RETIRED = _POOL.retired  # buffers a larger one replaced, kept for the graphs holding them


@triton.jit
def _router_route_kernel(x_ptr, rw_ptr, logits_ptr, count_ptr, bias_ptr, w_ptr, ids_ptr,
                         a_ptr, res_ptr, nw_ptr, new_res_ptr,
                         E, H, s_x, s_rw, s_l, s_a, s_r, s_nr, s_part, scale, eps,
                         TILE_E: tl.constexpr, TILE_K: tl.constexpr, EVEN_K: tl.constexpr,
                         TOP_K: tl.constexpr, NUM_SHARED: tl.constexpr,
                         BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr,
                         SIGMOID: tl.constexpr, HAS_BIAS: tl.constexpr, RENORM: tl.constexpr,
                         ROUND: tl.constexpr, ROUND_DTYPE: tl.constexpr,
                         N_GROUP: tl.constexpr, TOPK_GROUP: tl.constexpr,
                         GROUP_SIZE: tl.constexpr, BLOCK_G: tl.constexpr,
                         PRENORM: tl.constexpr, BLOCK_H: tl.constexpr,
                         PARTS: tl.constexpr, PDL: tl.constexpr):
    # TILE_E, TILE_K: the logits' tile (router_logits's BLOCK_E, BLOCK_K); BLOCK_E, BLOCK_K
    # and the rest: route_token's, as moe_route passes them. PRENORM: x is written here
    # first, rms_norm(a + res, nw) (BLOCK_H: H's power of two; PARTS > 0: a is a split-K
    # projection's float32 partial sums, s_part apart); without it a_ptr .. s_part, eps,
    # BLOCK_H and PARTS are unused
    if PDL:  # x (a, res) is the kernel before's output; and the counters' stream order
        follow()
    t = tl.program_id(1).to(tl.int64)
    if PRENORM:  # rms_norm's kernel body for row t, in each of t's programs (above)
        cols = tl.arange(0, BLOCK_H)
        mask = cols < H
        a = load_row(a_ptr, t * s_a + cols, mask, s_part, PARTS, res_ptr.dtype.element_ty)
        row = add_residual(a, tl.load(res_ptr + t * s_r + cols, mask=mask, other=0.0))
        if tl.program_id(0) == 0:  # one program writes the new residual (every one could)
            tl.store(new_res_ptr + t * s_nr + cols, row, mask=mask)
        y = rms_norm_row(row, nw_ptr, cols, mask, H, eps)  # [BLOCK_H] float32
        tl.store(x_ptr + t * s_x + cols, y.to(x_ptr.dtype.element_ty), mask=mask)
        tl.debug_barrier()  # the program's stores of x[t] before any of its threads reads
    store_logits(x_ptr, rw_ptr, logits_ptr, E, H, s_x, s_rw, s_l, tl.program_id(0), t,
                 TILE_E, TILE_K, EVEN_K)
    tl.debug_barrier()  # every thread's logits stored before the one-thread release below
    done = tl.atomic_add(count_ptr + t, 1, sem="acq_rel", scope="gpu")
    if done == tl.num_programs(0) - 1:  # the token's last program: all logits acquired
        tl.store(count_ptr + t, 0)  # no program of this launch touches count[t] again
        route_token(logits_ptr, bias_ptr, w_ptr, ids_ptr, E, s_l, scale, t, TOP_K,
                    NUM_SHARED, BLOCK_E, BLOCK_K, SIGMOID, HAS_BIAS, RENORM, ROUND,
                    ROUND_DTYPE, N_GROUP, TOPK_GROUP, GROUP_SIZE, BLOCK_G, True)


def counters(device: torch.device, tokens: int) -> torch.Tensor:
    """The device's counters for this kernel, at least `tokens` of them (all zero between
    launches; never allocated during a CUDA-graph capture: CounterPool.get)."""
    return _POOL.get(device, tokens)


def router_route(x: torch.Tensor, w: torch.Tensor, out_dtype: torch.dtype, top_k: int,
                 scoring_func: str, renormalize: bool, routed_scaling_factor: float = 1.0,
                 e_score_correction_bias: torch.Tensor | None = None,
                 round_dtype: torch.dtype | None = None, num_shared: int = 0,
                 n_group: int | None = None,
                 topk_group: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """moe_route(router_logits(x, w, out_dtype), top_k, ...) in one launch: x [T, H]
    (float), w [E, H] (float) -> (weights [T, k + S] float32, ids [T, k + S] int64).
    The arguments after out_dtype are moe_route's."""
    check_router_args(x, w)
    return _launch(x, w, out_dtype, None, top_k, scoring_func, renormalize,
                   routed_scaling_factor, e_score_correction_bias, round_dtype, num_shared,
                   n_group, topk_group)


def router_route_prenorm(x: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor,
                         eps: float, w: torch.Tensor, out_dtype: torch.dtype, top_k: int,
                         scoring_func: str, renormalize: bool,
                         routed_scaling_factor: float = 1.0,
                         e_score_correction_bias: torch.Tensor | None = None,
                         round_dtype: torch.dtype | None = None, num_shared: int = 0,
                         n_group: int | None = None, topk_group: int | None = None
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """normed, new_residual = rms_norm(x, norm_weight, eps, residual), then
    router_route(normed, w, out_dtype, top_k, ...), in one launch: x, residual [T, H]
    (float, one dtype), or x [S, T, H] float32 partial sums of a split-K projection
    (engine/models/split_k.py: summed and rounded to residual's dtype first, as rms_norm
    does); norm_weight [H] -> (weights, ids, normed [T, H] and new_residual [T, H] in
    residual's dtype). Inputs are not modified."""
    parts = x.shape[0] if x.dim() == 3 else 0
    check_router_args(x[0] if parts else x, w)
    t, h = x.shape[-2:]
    check_shape("residual", residual, (t, h))
    if parts:
        check(x.dtype == torch.float32, "x: partial sums must be float32")
    else:
        check(residual.dtype == x.dtype, "residual: dtype must match x")
    check(residual.stride(1) == 1, "residual: rows must be contiguous")
    check_shape("norm_weight", norm_weight, (h,))
    check_float("norm_weight", norm_weight)
    check(norm_weight.stride(0) == 1, "norm_weight: must be contiguous")
    check_device(x, residual, norm_weight)
    # new buffers both: the programs of a token read x and residual while its first one
    # writes the new residual, and all of them read the normed row they write
    normed = torch.empty(t, h, dtype=residual.dtype, device=x.device)
    new_res = torch.empty(t, h, dtype=residual.dtype, device=x.device)
    weights, ids = _launch(normed, w, out_dtype,
                           (x, residual, norm_weight, new_res, eps, parts),
                           top_k, scoring_func, renormalize, routed_scaling_factor,
                           e_score_correction_bias, round_dtype, num_shared, n_group,
                           topk_group)
    return weights, ids, normed, new_res


def _launch(x: torch.Tensor, w: torch.Tensor, out_dtype: torch.dtype,
            prenorm: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, float, int]
            | None, top_k: int, scoring_func: str, renormalize: bool,
            routed_scaling_factor: float, e_score_correction_bias: torch.Tensor | None,
            round_dtype: torch.dtype | None, num_shared: int, n_group: int | None,
            topk_group: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Both launchers' launch, x and w checked. prenorm: (a, residual, norm_weight,
    new_residual, eps, parts), x then being the normed row's output (parts > 0: a holds
    that many partial sums)."""
    t, h = x.shape
    e = w.shape[0]
    if e_score_correction_bias is not None:
        check_device(x, e_score_correction_bias)
    const = route_constexprs(e, top_k, scoring_func, renormalize, e_score_correction_bias,
                             round_dtype, num_shared, n_group, topk_group)
    row = top_k + num_shared
    weights = torch.empty(t, row, dtype=torch.float32, device=x.device)
    ids = torch.empty(t, row, dtype=torch.int64, device=x.device)
    if t == 0:
        return weights, ids
    logits = torch.empty(t, e, dtype=out_dtype, device=x.device)  # [T, E]
    count = counters(x.device, t)
    pdl = pdl_for(x)
    if prenorm is None:
        a, res, nw, new_res, eps, parts = x, x, x, x, 0.0, 0  # unused without PRENORM
        block_h, warps = 1, 4
    else:
        a, res, nw, new_res, eps, parts = prenorm
        block_h = triton.next_power_of_2(h)
        # rms_norm's warps for the row, so the same sum of squares (norm_warps); the
        # logits' tile and the routing run at any count
        warps = norm_warps(block_h)
    _router_route_kernel[(triton.cdiv(e, BLOCK_E), t)](
        x, w, logits, count,
        e_score_correction_bias if e_score_correction_bias is not None else logits,
        weights, ids, a, res, nw, new_res, e, h, x.stride(0), w.stride(0), logits.stride(0),
        a.stride(-2), res.stride(0), new_res.stride(0), a.stride(0) if parts else 0,
        float(routed_scaling_factor),
        float(eps), TILE_E=BLOCK_E, TILE_K=BLOCK_K, EVEN_K=h % BLOCK_K == 0, **const,
        PRENORM=prenorm is not None, BLOCK_H=block_h, PARTS=parts, PDL=pdl, num_warps=warps,
        launch_pdl=pdl)
    return weights, ids
