"""Triton form of the MLA step's latent work (kernels/ref_mla_latent.py's contract), one
program per token: RMSNorm of the compressed KV, rotate-half RoPE of the shared key and of
every query head's rope part, and the latent row's store into the paged cache.

Separately these are an RMSNorm, a RoPE, a concatenation and a latent store (plus copies
making the norm's and RoPE's inputs contiguous at batch > 1): four or more launches per
layer where a decode step at batch 1 spends a few microseconds on each whatever its size.
Each value is rounded where the separate kernels round it (kernels/triton_norm.py), so the
cache and the queries hold the same bits."""

from __future__ import annotations

from typing import Any, NamedTuple

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
from kernels.triton_norm import _rope_rows
from kernels.triton_store_kv import _to_cache

NUM_WARPS = 4


@triton.jit
def _mla_latent_kernel(
    kva_ptr, q_ptr, qo_ptr, w_ptr, pos_ptr, cs_ptr, kv_ptr, slot_ptr,
    s_a,  # kv_a row stride
    s_qt, s_qh,  # q token and head strides (q_ptr points at the first rope column)
    s_ot, s_oh,  # the same for the rotated q_pe's destination
    s_cs,  # cos_sin row stride
    s_cb, s_ct,  # kv_layer block and token strides [NB, 1, BS, 1, C + R]
    eps, scale,
    C: tl.constexpr, HALF: tl.constexpr, H: tl.constexpr, BS: tl.constexpr,
    CP: tl.constexpr, BLOCK_H: tl.constexpr, FP8: tl.constexpr, PDL: tl.constexpr,
):
    if PDL:  # kv_a and q are the kernel before's output (kernels/pdl.py)
        follow()
    mla_latent_body(kva_ptr, q_ptr, qo_ptr, w_ptr, pos_ptr, cs_ptr, kv_ptr, slot_ptr, s_a,
                    s_qt, s_qh, s_ot, s_oh, s_cs, s_cb, s_ct, eps, scale,
                    tl.program_id(0).to(tl.int64), C, HALF, H, BS, CP, BLOCK_H, FP8)


@triton.jit
def mla_latent_body(
    kva_ptr, q_ptr, qo_ptr, w_ptr, pos_ptr, cs_ptr, kv_ptr, slot_ptr,
    s_a, s_qt, s_qh, s_ot, s_oh, s_cs, s_cb, s_ct,  # as _mla_latent_kernel's
    eps, scale,
    t,  # int64: the token this program owns
    C: tl.constexpr, HALF: tl.constexpr, H: tl.constexpr, BS: tl.constexpr,
    CP: tl.constexpr, BLOCK_H: tl.constexpr, FP8: tl.constexpr,
):
    """One token's latent work, the program id an argument so that another kernel
    (kernels/triton_mla_latent_absorb.py) can run it on a part of its grid (jit helpers
    are inlined). No PDL wait here: the calling kernel's first statement does it."""
    pos = tl.load(pos_ptr + t).to(tl.int64)
    d = tl.arange(0, HALF)
    cos = tl.load(cs_ptr + pos * s_cs + d)  # [HALF] float32
    sin = tl.load(cs_ptr + pos * s_cs + HALF + d)
    # the queries' rope parts, in place or into the destination (each head's halves are
    # loaded before its stores)
    _rope_rows(q_ptr, qo_ptr, s_qt, s_qh, s_ot, s_oh, t, cos[None, :], sin[None, :],
               H, HALF, BLOCK_H)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot >= 0:  # else a padding token (a graph's padding row): nothing to store
        row = kva_ptr + t * s_a
        cols = tl.arange(0, CP)  # C padded to a power of two
        cm = cols < C
        x = tl.load(row + cols, mask=cm, other=0.0)
        xf = x.to(tl.float32)
        rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=0) / C + eps)
        w = tl.load(w_ptr + cols, mask=cm, other=0.0).to(tl.float32)
        normed = ((xf * rstd).to(x.dtype).to(tl.float32) * w).to(x.dtype)
        k1 = tl.load(row + C + d).to(tl.float32)
        k2 = tl.load(row + C + HALF + d).to(tl.float32)
        ty = kv_ptr.dtype.element_ty
        blk = slot // BS
        dst = kv_ptr + blk * s_cb + (slot - blk * BS) * s_ct
        tl.store(dst + cols, _to_cache(normed, scale, ty, FP8), mask=cm)
        tl.store(dst + C + d, _to_cache((k1 * cos - k2 * sin).to(x.dtype), scale, ty, FP8))
        tl.store(dst + C + HALF + d,
                 _to_cache((k2 * cos + k1 * sin).to(x.dtype), scale, ty, FP8))


class LatentLaunch(NamedTuple):
    """mla_latent_store's arguments once checked: what a kernel running mla_latent_body
    launches with (that kernel's, or kernels/triton_mla_latent_absorb.py's)."""

    tokens: int  # T: one program each
    args: tuple[Any, ...]  # mla_latent_body's runtime arguments but t, in its order
    consts: dict[str, Any]  # its constexprs


def latent_launch(
    kv_a: torch.Tensor, q: torch.Tensor, norm_weight: torch.Tensor, eps: float,
    positions: torch.Tensor, cos_sin: torch.Tensor, kv_layer: torch.Tensor,
    slot_mapping: torch.Tensor, scale: float, q_pe_out: torch.Tensor | None,
) -> LatentLaunch:
    """mla_latent_store's argument checks (ValueError naming the argument), and the launch
    they leave."""
    check(kv_a.dim() == 2 and q.dim() == 3, "kv_a, q: expected [T, C + R], [T, H, Dn + R]")
    t, width = kv_a.shape
    r = cos_sin.shape[1] if cos_sin.dim() == 2 else 0
    check(cos_sin.dim() == 2 and r % 2 == 0 and r & (r - 1) == 0 and 0 < r < width,
          f"cos_sin: expected [max_pos, R], R a power of two below {width}")
    check(cos_sin.dtype == torch.float32 and cos_sin.stride(1) == 1,
          "cos_sin: expected contiguous rows of float32")
    c = width - r
    check(q.shape[0] == t and q.shape[2] > r, f"q: expected [{t}, H, Dn + {r}]")
    check_shape("norm_weight", norm_weight, (c,))
    check_shape("positions", positions, (t,))
    check_shape("slot_mapping", slot_mapping, (t,))
    check(kv_layer.dim() == 5 and kv_layer.shape[1] == 1 and kv_layer.shape[3] == 1
          and kv_layer.shape[4] == width, f"kv_layer: expected [NB, 1, BS, 1, {width}]")
    check(kv_a.stride(1) == 1 and q.stride(2) == 1 and kv_layer.stride(4) == 1
          and norm_weight.stride(0) == 1, "kv_a, q, kv_layer, norm_weight: last dim must "
          "be contiguous")
    check_float("kv_a", kv_a)
    check(q.dtype == kv_a.dtype, f"q: expected kv_a's dtype {kv_a.dtype}, got {q.dtype}")
    check_kv("kv_layer", kv_layer)
    check_int("positions", positions)
    check_int("slot_mapping", slot_mapping)
    check_device(kv_a, q, norm_weight, positions, cos_sin, kv_layer, slot_mapping)
    h = q.shape[1]
    q_pe = q[..., q.shape[2] - r:]
    out = q_pe if q_pe_out is None else q_pe_out
    check_shape("q_pe_out", out, (t, h, r))
    check(out.stride(2) == 1 and out.dtype == q.dtype,
          "q_pe_out: expected q's dtype and a contiguous last dim")
    check_device(q, out)
    return LatentLaunch(t, (
        kv_a, q_pe, out, norm_weight, positions, cos_sin, kv_layer, slot_mapping,
        kv_a.stride(0), q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        cos_sin.stride(0), kv_layer.stride(0), kv_layer.stride(2), float(eps), float(scale)),
        dict(C=c, HALF=r // 2, H=h, BS=kv_layer.shape[2], CP=triton.next_power_of_2(c),
             BLOCK_H=triton.next_power_of_2(h), FP8=is_fp8(kv_layer)))


def mla_latent_store(
    kv_a: torch.Tensor,  # [T, C + R], rows contiguous
    q: torch.Tensor,  # [T, H, Dn + R], last dim contiguous; q_pe rotated in place
    norm_weight: torch.Tensor,  # [C]
    eps: float,
    positions: torch.Tensor,  # [T] int32/int64
    cos_sin: torch.Tensor,  # [max_pos, R] float32
    kv_layer: torch.Tensor,  # [NB, 1, BS, 1, C + R]
    slot_mapping: torch.Tensor,  # [T] int32/int64; < 0 skips the store
    *,
    scale: float = 1.0,
    q_pe_out: torch.Tensor | None = None,  # [T, H, R], last dim contiguous; None: in place
) -> None:
    a = latent_launch(kv_a, q, norm_weight, eps, positions, cos_sin, kv_layer, slot_mapping,
                      scale, q_pe_out)
    if a.tokens == 0:
        return
    pdl = pdl_for(kv_a)
    _mla_latent_kernel[(a.tokens,)](*a.args, **a.consts, PDL=pdl, num_warps=NUM_WARPS,
                                    launch_pdl=pdl)
