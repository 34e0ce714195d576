"""Triton RoPE fused with the KV store: one program per token rotates its q and k heads,
writes q out and k, v into their paged cache slot (see ref_rope_kv.rope_store_kv_ref).

Unfused, a decode step launches a rope kernel and a store kernel per layer, each a few
microseconds of launch and tail for a few KiB of data; here it is one, and the rotated k
goes straight to the cache without a round trip through a temporary. Rounding is the
reference's: k is rotated in float32, rounded to k's dtype, then to the cache's (a float8
cache: divided by the layer's scale and saturated first, triton_store_kv._to_cache).

With ``qk_norm`` the kernel first applies each head's RMSNorm to q and k (Qwen3's q_norm
and k_norm), with kernels/triton_norm's arithmetic. Run apart, those norms were two
RMSNorm launches of one 128-value row per program plus two copies (q and k are strided
views of the qkv projection) a layer. In a Qwen3-30B-A3B-shaped 4,096-token prefill on an
H100, RMSNorm took 10.5 of the 79 ms of kernels in 193 launches (four a layer, two of them
these) and the copies 2.4 ms (bench/RESULTS.md).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.pdl import follow, pdl_for
from kernels.triton_common import (
    check,
    check_device,
    check_float,
    check_int,
    check_kv,
    check_shape,
    is_fp8,
)
from kernels.triton_store_kv import _to_cache


@triton.jit
def _load(src, mask, s_part, PARTS: tl.constexpr, TY: tl.constexpr):
    """x as float32, rounded to TY as the projection's output would be: PARTS > 0 sums that
    many float32 partial sums s_part apart (a K-split projection, engine/models/split_k)."""
    if PARTS > 0:
        x = tl.load(src, mask=mask, other=0.0)
        for p in tl.static_range(1, PARTS):
            x += tl.load(src + p * s_part, mask=mask, other=0.0)
        return x.to(TY).to(tl.float32)
    return tl.load(src, mask=mask, other=0.0).to(tl.float32)


@triton.jit
def _head_norm(x1, x2, w_ptr, d, eps, HALF: tl.constexpr, TY: tl.constexpr):
    """Each head's (row's) RMSNorm over its two halves, rounded as triton_norm's kernel
    rounds: the normed row to TY, times the weight, to TY again."""
    ss = tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)  # [BLOCK_H]
    rstd = (1.0 / tl.sqrt(ss / (2 * HALF) + eps))[:, None]
    w1 = tl.load(w_ptr + d).to(tl.float32)  # [1, HALF]
    w2 = tl.load(w_ptr + HALF + d).to(tl.float32)
    y1 = ((x1 * rstd).to(TY).to(tl.float32) * w1).to(TY).to(tl.float32)
    y2 = ((x2 * rstd).to(TY).to(tl.float32) * w2).to(TY).to(tl.float32)
    return y1, y2


@triton.jit
def _rotate(x_ptr, s_xt, s_xh, t, cos, sin, s_part, w_ptr, eps, H: tl.constexpr,
            HALF: tl.constexpr, BLOCK_H: tl.constexpr, PARTS: tl.constexpr, TY: tl.constexpr,
            NORM: tl.constexpr):
    h = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, HALF)[None, :]
    mask = h < H
    src = x_ptr + t * s_xt + h * s_xh + d  # [BLOCK_H, HALF]: first halves
    x1 = _load(src, mask, s_part, PARTS, TY)
    x2 = _load(src + HALF, mask, s_part, PARTS, TY)
    if NORM:
        x1, x2 = _head_norm(x1, x2, w_ptr, d, eps, HALF, TY)
    return (x1 * cos - x2 * sin).to(TY), (x2 * cos + x1 * sin).to(TY), h, d, mask


@triton.jit
def _rope_store_kv_kernel(
    q_ptr, k_ptr, v_ptr, qo_ptr, kv_ptr, pos_ptr, cs_ptr, slot_ptr,
    qw_ptr, kw_ptr, eps,  # NORM: q's and k's per-head RMSNorm weights [D] and epsilon
    s_qt, s_qh, s_kt, s_kh, s_vt, s_vh, s_qot, s_qoh, s_cs,
    s_cb, s_ckv, s_cs2, s_ch,  # kv_layer strides [NB, 2, BS, Hkv, D]; D contiguous
    s_part,  # PARTS > 0: stride between q/k/v's float32 partial sums
    k_scale, v_scale,  # FP8: what the cache entries are multiplied by when read
    HQ: tl.constexpr, HKV: tl.constexpr, HALF: tl.constexpr, BS: tl.constexpr,
    BLOCK_HQ: tl.constexpr, BLOCK_HKV: tl.constexpr, PARTS: tl.constexpr, FP8: tl.constexpr,
    NORM: tl.constexpr, PDL: tl.constexpr,
):
    if PDL:  # q/k/v are the kernel before's output (kernels/pdl.py)
        follow()
    TY = qo_ptr.dtype.element_ty  # the projection's (the model's) dtype
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    dc = tl.arange(0, HALF)[None, :]
    cos = tl.load(cs_ptr + pos * s_cs + dc)  # [1, HALF] float32, shared by every head
    sin = tl.load(cs_ptr + pos * s_cs + HALF + dc)
    q1, q2, h, d, mask = _rotate(q_ptr, s_qt, s_qh, t, cos, sin, s_part, qw_ptr, eps, HQ,
                                 HALF, BLOCK_HQ, PARTS, TY, NORM)
    dst = qo_ptr + t * s_qot + h * s_qoh + d
    tl.store(dst, q1, mask=mask)
    tl.store(dst + HALF, q2, mask=mask)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    k1, k2, hk, dk, kmask = _rotate(k_ptr, s_kt, s_kh, t, cos, sin, s_part, kw_ptr, eps, HKV,
                                    HALF, BLOCK_HKV, PARTS, TY, NORM)
    kmask = kmask & (slot >= 0)  # padding tokens (slot < 0) store nothing
    blk = tl.maximum(slot, 0) // BS
    cache = kv_ptr + blk * s_cb + (tl.maximum(slot, 0) - blk * BS) * s_cs2 + hk * s_ch + dk
    ty = kv_ptr.dtype.element_ty
    tl.store(cache, _to_cache(k1, k_scale, ty, FP8), mask=kmask)
    tl.store(cache + HALF, _to_cache(k2, k_scale, ty, FP8), mask=kmask)
    vsrc = v_ptr + t * s_vt + hk * s_vh + dk
    v1 = _load(vsrc, kmask, s_part, PARTS, TY).to(TY)  # rounded as the projection's output
    v2 = _load(vsrc + HALF, kmask, s_part, PARTS, TY).to(TY)
    tl.store(cache + s_ckv, _to_cache(v1, v_scale, ty, FP8), mask=kmask)
    tl.store(cache + s_ckv + HALF, _to_cache(v2, v_scale, ty, FP8), mask=kmask)


def rope_store_kv(
    q: torch.Tensor,  # [T, Hq, D]
    k: torch.Tensor,  # [T, Hkv, D]
    v: torch.Tensor,  # [T, Hkv, D]
    positions: torch.Tensor,  # [T] int32/int64
    cos_sin: torch.Tensor,  # [max_pos, D] float32
    kv_layer: torch.Tensor,  # [NB, 2, BS, Hkv, D]
    slot_mapping: torch.Tensor,  # [T] int32/int64; < 0 skips
    out_dtype: torch.dtype | None = None,  # with partial sums: the projection's dtype
    *,
    k_scale: float = 1.0,  # float8 cache: this layer's K and V scales
    v_scale: float = 1.0,
    qk_norm: tuple[torch.Tensor, torch.Tensor, float] | None = None,
) -> torch.Tensor:
    """q, k, v may instead be [S, T, H, D] float32 partial sums of a K-split projection
    (views of one tensor): they are summed and rounded to out_dtype first. qk_norm
    (q's weight [D], k's weight [D], eps): each head of q and k is RMS-normed first."""
    parts, s_part = 0, 0
    if q.dim() == 4:
        check(k.dim() == 4 and v.dim() == 4 and q.shape[0] == k.shape[0] == v.shape[0],
              "q, k, v: partial sums must all be [S, T, H, D]")
        check(q.dtype == k.dtype == v.dtype == torch.float32,
              "q, k, v: partial sums must be float32")
        check(q.stride(0) == k.stride(0) == v.stride(0),
              "q, k, v: partial sums must be views of one [S, T, *] tensor")
        check(out_dtype is not None, "out_dtype: required with partial sums")
        parts, s_part = q.shape[0], q.stride(0)
        q, k, v = q[0], k[0], v[0]
    check(q.dim() == 3 and k.dim() == 3, "q, k: expected [T, H, D]")
    num_tokens, hq, d = q.shape
    hkv = k.shape[1]
    check_shape("k", k, (num_tokens, hkv, d))
    check_shape("v", v, (num_tokens, hkv, d))
    check_shape("positions", positions, (num_tokens,))
    check_shape("slot_mapping", slot_mapping, (num_tokens,))
    check(kv_layer.dim() == 5 and kv_layer.shape[1] == 2, "kv_layer: expected [NB, 2, BS, Hkv, D]")
    check_shape("kv_layer[0, 0, 0]", kv_layer[0, 0, 0], (hkv, d))
    check(cos_sin.dim() == 2 and cos_sin.shape[1] == d, "cos_sin: expected [max_pos, D]")
    check(cos_sin.dtype == torch.float32 and cos_sin.stride(1) == 1,
          "cos_sin: expected contiguous rows of float32")
    check(d % 2 == 0 and (d & (d - 1)) == 0, f"head_dim {d} must be a power of two")
    check(q.stride(2) == 1 and k.stride(2) == 1 and v.stride(2) == 1
          and kv_layer.stride(4) == 1, "q, k, v, kv_layer: head_dim must be contiguous")
    for name, t in (("q", q), ("k", k), ("v", v)):
        check_float(name, t)
    check_kv("kv_layer", kv_layer)
    check_int("positions", positions)
    check_int("slot_mapping", slot_mapping)
    check_device(q, k, v, positions, cos_sin, kv_layer, slot_mapping)
    qw, kw, eps = q, q, 0.0  # without qk_norm the kernel never reads the weights
    if qk_norm is not None:
        qw, kw, eps = qk_norm
        check_shape("qk_norm q weight", qw, (d,))
        check_shape("qk_norm k weight", kw, (d,))
        check_float("qk_norm q weight", qw)
        check_float("qk_norm k weight", kw)
        check(qw.stride(0) == 1 and kw.stride(0) == 1, "qk_norm weights: expected contiguous")
        check_device(q, qw, kw)
    q_out = torch.empty(q.shape, dtype=out_dtype or q.dtype, device=q.device)
    if num_tokens == 0:
        return q_out
    pdl = pdl_for(q)
    _rope_store_kv_kernel[(num_tokens,)](
        q, k, v, q_out, kv_layer, positions, cos_sin, slot_mapping, qw, kw, float(eps),
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        q_out.stride(0), q_out.stride(1), cos_sin.stride(0),
        kv_layer.stride(0), kv_layer.stride(1), kv_layer.stride(2), kv_layer.stride(3),
        s_part, float(k_scale), float(v_scale),
        HQ=hq, HKV=hkv, HALF=d // 2, BS=kv_layer.shape[2],
        BLOCK_HQ=triton.next_power_of_2(hq), BLOCK_HKV=triton.next_power_of_2(hkv),
        PARTS=parts, FP8=is_fp8(kv_layer), NORM=qk_norm is not None, PDL=pdl, num_warps=4,
        launch_pdl=pdl,
    )
    return q_out
