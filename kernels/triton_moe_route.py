"""Triton top-k routing of a mixture-of-experts layer (kernels/ref_moe.moe_route_ref's
contract), one program per token: the router's scores (softmax, or sigmoid with a
score-correction bias), expert groups, top-k, renormalization and scaling, and the shared
experts' columns, the ids and weights kernels/triton_moe.fused_moe takes."""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

from kernels.pdl import follow, pdl_for
from kernels.triton_common import check, check_device, check_float


@triton.jit
def route_token(logits_ptr, bias_ptr, w_ptr, ids_ptr, E, s_l, scale, t,
                TOP_K: tl.constexpr, NUM_SHARED: tl.constexpr, BLOCK_E: tl.constexpr,
                BLOCK_K: tl.constexpr,
                SIGMOID: tl.constexpr, HAS_BIAS: tl.constexpr, RENORM: tl.constexpr,
                ROUND: tl.constexpr, ROUND_DTYPE: tl.constexpr,
                N_GROUP: tl.constexpr, TOPK_GROUP: tl.constexpr, GROUP_SIZE: tl.constexpr,
                BLOCK_G: tl.constexpr, L2_LOGITS: tl.constexpr):
    """Token t's routing: its logits row in, its TOP_K + NUM_SHARED weights and ids out.
    The body of _route_kernel and of kernels/triton_router_route.py's fused kernel (Triton
    inlines it into both). L2_LOGITS: other programs of the same launch wrote the logits,
    so they are read from L2 (.cg): this SM's L1 is not coherent with their stores."""
    es = tl.arange(0, BLOCK_E)
    ok = es < E
    if L2_LOGITS:
        x = tl.load(logits_ptr + t * s_l + es, mask=ok, other=float("-inf"),
                    cache_modifier=".cg").to(tl.float32)
    else:
        x = tl.load(logits_ptr + t * s_l + es, mask=ok, other=float("-inf")).to(tl.float32)
    if SIGMOID:
        scores = 1.0 / (1.0 + tl.exp(-x))
    else:
        p = tl.exp(x - tl.max(x, axis=0))
        scores = p / tl.sum(p, axis=0)
    scores = tl.where(ok, scores, 0.0)
    choice = scores
    if HAS_BIAS:
        choice = scores + tl.load(bias_ptr + es, mask=ok, other=0.0).to(tl.float32)
    choice = tl.where(ok, choice, float("-inf"))
    if N_GROUP > 1:
        # a group's score: its best choice (softmax) or its two best summed (sigmoid, a
        # tie counting twice as topk(2) does); the first maximum wins ties throughout
        grp = es // GROUP_SIZE
        gs_idx = tl.arange(0, BLOCK_G)
        gs = tl.full([BLOCK_G], float("-inf"), tl.float32)
        for g in tl.static_range(N_GROUP):
            mine = tl.where(grp == g, choice, float("-inf"))
            best = tl.max(mine, axis=0)
            score = best
            if SIGMOID and GROUP_SIZE > 1:
                first = tl.min(tl.where(mine == best, es, BLOCK_E), axis=0)
                score = best + tl.max(tl.where(es == first, float("-inf"), mine), axis=0)
            gs = tl.where(gs_idx == g, score, gs)
        keep = es < 0  # all False
        for _ in tl.static_range(TOPK_GROUP):
            top = tl.max(gs, axis=0)
            gi = tl.min(tl.where(gs == top, gs_idx, BLOCK_G), axis=0)
            keep = keep | (grp == gi)
            gs = tl.where(gs_idx == gi, float("-inf"), gs)
        # dropped experts: softmax scores 0 (V2), sigmoid choices never picked (V3)
        if SIGMOID:
            choice = tl.where(keep, choice, float("-inf"))
        else:
            choice = tl.where(keep | ~ok, choice, 0.0)
    ks = tl.arange(0, BLOCK_K)
    picked = tl.zeros([BLOCK_K], dtype=tl.float32)  # the chosen experts' scores, in order
    picked_ids = tl.zeros([BLOCK_K], dtype=tl.int64)
    for j in tl.static_range(TOP_K):
        best = tl.max(choice, axis=0)
        idx = tl.min(tl.where(choice == best, es, BLOCK_E), axis=0)  # the first maximum
        w = tl.sum(tl.where(es == idx, scores, 0.0), axis=0)
        picked = tl.where(ks == j, w, picked)
        picked_ids = tl.where(ks == j, idx.to(tl.int64), picked_ids)
        choice = tl.where(es == idx, float("-inf"), choice)
    if RENORM:
        total = tl.sum(picked, axis=0)
        if SIGMOID:
            total += 1e-20
        picked = picked / total
    picked = picked * scale
    if ROUND:
        picked = picked.to(ROUND_DTYPE).to(tl.float32)
    # the shared experts (ids E .. E + NUM_SHARED - 1) follow with weight 1, unscaled
    shared = (ks >= TOP_K) & (ks < TOP_K + NUM_SHARED)
    picked = tl.where(shared, 1.0, picked)
    picked_ids = tl.where(shared, (E + ks - TOP_K).to(tl.int64), picked_ids)
    row = TOP_K + NUM_SHARED
    kmask = ks < row
    tl.store(w_ptr + t * row + ks, picked, mask=kmask)
    tl.store(ids_ptr + t * row + ks, picked_ids, mask=kmask)


@triton.jit
def _route_kernel(logits_ptr, bias_ptr, w_ptr, ids_ptr, E, s_l, scale,
                  TOP_K: tl.constexpr, NUM_SHARED: tl.constexpr, BLOCK_E: tl.constexpr,
                  BLOCK_K: tl.constexpr,
                  SIGMOID: tl.constexpr, HAS_BIAS: tl.constexpr, RENORM: tl.constexpr,
                  ROUND: tl.constexpr, ROUND_DTYPE: tl.constexpr,
                  N_GROUP: tl.constexpr, TOPK_GROUP: tl.constexpr, GROUP_SIZE: tl.constexpr,
                  BLOCK_G: tl.constexpr, PDL: tl.constexpr):
    if PDL:  # the router's logits are the kernel before's output (kernels/pdl.py)
        follow()
    route_token(logits_ptr, bias_ptr, w_ptr, ids_ptr, E, s_l, scale,
                tl.program_id(0).to(tl.int64), TOP_K, NUM_SHARED, BLOCK_E, BLOCK_K, SIGMOID,
                HAS_BIAS, RENORM, ROUND, ROUND_DTYPE, N_GROUP, TOPK_GROUP, GROUP_SIZE,
                BLOCK_G, False)


_ROUND = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


def route_constexprs(e: int, top_k: int, scoring_func: str, renormalize: bool,
                     bias: torch.Tensor | None, round_dtype: torch.dtype | None,
                     num_shared: int, n_group: int | None,
                     topk_group: int | None) -> dict[str, Any]:
    """Checks the routing arguments of E experts and returns route_token's constexprs
    (moe_route's, and kernels/triton_router_route.py's fused launcher's)."""
    check(scoring_func in ("softmax", "sigmoid"),
          f"scoring_func: must be 'softmax' or 'sigmoid', got {scoring_func!r}")
    check(1 <= top_k <= e, f"top_k: must be in [1, {e}], got {top_k}")
    if bias is not None:
        check(tuple(bias.shape) == (e,), f"e_score_correction_bias: expected shape ({e},)")
    check(num_shared >= 0, f"num_shared: must be >= 0, got {num_shared}")
    groups = n_group if n_group is not None and topk_group is not None and n_group > 1 else 1
    if groups > 1:
        assert topk_group is not None
        check(e % groups == 0, f"n_group: {groups} does not divide the {e} experts")
        check(1 <= topk_group <= groups, f"topk_group: must be in [1, {groups}], got "
              f"{topk_group}")
    rnd = _ROUND.get(round_dtype) if round_dtype is not None else None
    return dict(
        TOP_K=top_k, NUM_SHARED=num_shared, BLOCK_E=triton.next_power_of_2(e),
        BLOCK_K=triton.next_power_of_2(top_k + num_shared), SIGMOID=scoring_func == "sigmoid",
        HAS_BIAS=bias is not None, RENORM=renormalize, ROUND=rnd is not None,
        ROUND_DTYPE=rnd if rnd is not None else tl.float32, N_GROUP=groups,
        TOPK_GROUP=topk_group if groups > 1 else 1, GROUP_SIZE=e // groups,
        BLOCK_G=triton.next_power_of_2(groups))


def moe_route(logits: torch.Tensor, top_k: int, scoring_func: str, renormalize: bool,
              routed_scaling_factor: float = 1.0,
              e_score_correction_bias: torch.Tensor | None = None,
              round_dtype: torch.dtype | None = None,
              num_shared: int = 0, n_group: int | None = None,
              topk_group: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """kernels.ref_moe.moe_route_ref in one program per token: at decode the torch form is
    eight small kernels per layer (casts, softmax, top-k, gather, sum, divide, rounding),
    about twenty with expert groups. num_shared: the shared experts' columns are written
    by the same program. Ties go to the lowest expert (and group) index."""
    check(logits.dim() == 2, "logits: expected [T, E]")
    check_float("logits", logits)
    check(logits.stride(1) == 1, "logits: rows must be contiguous")
    t, e = logits.shape
    if e_score_correction_bias is not None:
        check_device(logits, e_score_correction_bias)
    const = route_constexprs(e, top_k, scoring_func, renormalize, e_score_correction_bias,
                             round_dtype, num_shared, n_group, topk_group)
    row = top_k + num_shared
    weights = torch.empty(t, row, dtype=torch.float32, device=logits.device)
    ids = torch.empty(t, row, dtype=torch.int64, device=logits.device)
    if t == 0:
        return weights, ids
    pdl = pdl_for(logits)
    _route_kernel[(t,)](
        logits, e_score_correction_bias if e_score_correction_bias is not None else logits,
        weights, ids, e, logits.stride(0), float(routed_scaling_factor), **const, PDL=pdl,
        num_warps=4, launch_pdl=pdl)
    return weights, ids
