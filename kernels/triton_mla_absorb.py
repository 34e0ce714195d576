"""Triton forms of MLA decode's two per-head products for a few rows (the absorbed form,
engine/models/mla.py): the queries onto the latent (q_nope @ W_UK) and the latent output
back to values (o_lat @ W_UV^T), each as one dot-free kernel.

At decode these are batched GEMMs of one to a few rows per head: cuBLAS runs each as its own
launch at ~3.3 µs on an H200 for ~2 MB of weights (DeepSeek-V2-Lite, 16 heads; bench/
RESULTS.md's decode profile), about 15% of HBM read, and as cuBLAS kernels they wait for
the kernel before to finish (no programmatic dependent launch). Here a program owns one
head and one block of output columns, streams that head's weight tile once and multiplies
it by up to ROWS rows, summing in float32 and rounding the result once, as the GEMM does.
The weights are views of kv_b_proj's [H, Dn + Dv, C] weight, read with their strides.

Reference: the torch.bmm calls in engine/models/mla.py (same math, another summation order).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
import triton
import triton.language as tl

from kernels.pdl import follow, pdl_for
from kernels.triton_common import check, check_device, check_float

ROWS = 4  # rows of the activation one program multiplies its weight tile by (the most)
BLOCK_C = 128  # latent columns per program of the absorb product
BLOCK_D = 32  # value columns per program of the up product
# the absorb product's warps: at DeepSeek's Dn 128 a program's [128, 128] float32 weight tile
# is 64 values a thread at 8 warps (128 at 4)
NUM_WARPS = 8


@triton.jit
def _absorb_kernel(q_ptr, w_ptr, out_ptr, B, s_qb, s_qh, s_wh, s_wd, s_ob, s_oh,
                   D: tl.constexpr, C: tl.constexpr, DP: tl.constexpr, BLOCK_C: tl.constexpr,
                   ROWS: tl.constexpr, PDL: tl.constexpr):
    """out[b, h, c] = sum_d q[b, h, d] * w[h, d, c]."""
    if PDL:  # q is the kernel before's output; out may reuse its memory (kernels/pdl.py)
        follow()
    absorb_body(q_ptr, w_ptr, out_ptr, B, s_qb, s_qh, s_wh, s_wd, s_ob, s_oh,
                tl.program_id(0).to(tl.int64), tl.program_id(1), tl.program_id(2),
                D, C, DP, BLOCK_C, ROWS)


@triton.jit
def absorb_body(q_ptr, w_ptr, out_ptr, B, s_qb, s_qh, s_wh, s_wd, s_ob, s_oh,
                h,  # int64: the head
                cb,  # the block of BLOCK_C output columns
                rg,  # the group of ROWS rows
                D: tl.constexpr, C: tl.constexpr, DP: tl.constexpr, BLOCK_C: tl.constexpr,
                ROWS: tl.constexpr):
    """One program of _absorb_kernel, its place in the grid given as arguments so that
    another kernel (kernels/triton_mla_latent_absorb.py) can run it on a part of its grid
    (jit helpers are inlined). No PDL wait here: the calling kernel's first statement does
    it."""
    cs = cb * BLOCK_C + tl.arange(0, BLOCK_C)
    b0 = rg * ROWS
    ds = tl.arange(0, DP)
    dmask = ds < D
    cmask = cs < C
    w = tl.load(w_ptr + h * s_wh + ds[:, None] * s_wd + cs[None, :],
                mask=dmask[:, None] & cmask[None, :], other=0.0).to(tl.float32)  # [DP, BC]
    for r in tl.static_range(ROWS):
        b = b0 + r
        if b < B:
            q = tl.load(q_ptr + b.to(tl.int64) * s_qb + h * s_qh + ds, mask=dmask,
                        other=0.0).to(tl.float32)
            acc = tl.sum(w * q[:, None], axis=0)  # [BC]
            tl.store(out_ptr + b.to(tl.int64) * s_ob + h * s_oh + cs,
                     acc.to(out_ptr.dtype.element_ty), mask=cmask)


@triton.jit
def _up_kernel(x_ptr, w_ptr, out_ptr, B, s_xb, s_xh, s_wh, s_wd, s_ob, s_oh,
               C: tl.constexpr, DV: tl.constexpr, CP: tl.constexpr, BLOCK_D: tl.constexpr,
               ROWS: tl.constexpr, PDL: tl.constexpr):
    """out[b, h, d] = sum_c x[b, h, c] * w[h, d, c]."""
    if PDL:  # x is the kernel before's output (kernels/pdl.py)
        follow()
    h = tl.program_id(0).to(tl.int64)
    dv = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    b0 = tl.program_id(2) * ROWS
    cs = tl.arange(0, CP)
    cmask = cs < C
    dmask = dv < DV
    w = tl.load(w_ptr + h * s_wh + dv[:, None] * s_wd + cs[None, :],
                mask=dmask[:, None] & cmask[None, :], other=0.0).to(tl.float32)  # [BD, CP]
    for r in tl.static_range(ROWS):
        b = b0 + r
        if b < B:
            x = tl.load(x_ptr + b.to(tl.int64) * s_xb + h * s_xh + cs, mask=cmask,
                        other=0.0).to(tl.float32)
            acc = tl.sum(w * x[None, :], axis=1)  # [BD]
            tl.store(out_ptr + b.to(tl.int64) * s_ob + h * s_oh + dv,
                     acc.to(out_ptr.dtype.element_ty), mask=dmask)


def _check(name: str, t: torch.Tensor, shape: tuple[int, ...]) -> None:
    check(tuple(t.shape) == shape, f"{name}: expected {shape}, got {tuple(t.shape)}")
    check(t.stride(-1) == 1, f"{name}: last dim must be contiguous")


class AbsorbLaunch(NamedTuple):
    """mla_absorb_q's arguments once checked: what a kernel running absorb_body launches
    with (_absorb_kernel, or kernels/triton_mla_latent_absorb.py's)."""

    rows: int  # B
    heads: int  # H
    col_blocks: int  # blocks of BLOCK_C latent columns
    row_groups: int  # groups of ROWS rows
    args: tuple[Any, ...]  # absorb_body's runtime arguments before its place in the grid
    consts: dict[str, Any]  # its constexprs


def absorb_q_launch(q_nope: torch.Tensor, w_uk: torch.Tensor,
                    out: torch.Tensor) -> AbsorbLaunch:
    """mla_absorb_q's argument checks (ValueError naming the argument), and the launch they
    leave."""
    check(q_nope.dim() == 3 and w_uk.dim() == 3, "q_nope, w_uk: expected [B, H, Dn], [H, Dn, C]")
    b, h, d = q_nope.shape
    c = w_uk.shape[2]
    _check("w_uk", w_uk, (h, d, c))
    _check("q_nope", q_nope, (b, h, d))
    _check("out", out, (b, h, c))
    check_float("q_nope", q_nope)
    check_device(q_nope, w_uk, out)
    return AbsorbLaunch(
        b, h, triton.cdiv(c, BLOCK_C), triton.cdiv(b, ROWS),
        (q_nope, w_uk, out, b, q_nope.stride(0), q_nope.stride(1), w_uk.stride(0),
         w_uk.stride(1), out.stride(0), out.stride(1)),
        dict(D=d, C=c, DP=triton.next_power_of_2(d), BLOCK_C=BLOCK_C, ROWS=ROWS))


def mla_absorb_q(q_nope: torch.Tensor, w_uk: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """q_nope [B, H, Dn] @ w_uk [H, Dn, C] per head -> out [B, H, C] (strided views fine)."""
    a = absorb_q_launch(q_nope, w_uk, out)
    if a.rows == 0:
        return out
    pdl = pdl_for(q_nope)
    _absorb_kernel[(a.heads, a.col_blocks, a.row_groups)](
        *a.args, **a.consts, PDL=pdl, num_warps=NUM_WARPS, launch_pdl=pdl)
    return out


def mla_up_v(o_lat: torch.Tensor, w_uv: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """o_lat [B, H, C] @ w_uv[h]^T (w_uv [H, Dv, C]) per head -> out [B, H, Dv]."""
    check(o_lat.dim() == 3 and w_uv.dim() == 3, "o_lat, w_uv: expected [B, H, C], [H, Dv, C]")
    b, h, c = o_lat.shape
    dv = w_uv.shape[1]
    _check("w_uv", w_uv, (h, dv, c))
    _check("o_lat", o_lat, (b, h, c))
    _check("out", out, (b, h, dv))
    check_float("o_lat", o_lat)
    check_device(o_lat, w_uv, out)
    if b == 0:
        return out
    pdl = pdl_for(o_lat)
    _up_kernel[(h, triton.cdiv(dv, BLOCK_D), triton.cdiv(b, ROWS))](
        o_lat, w_uv, out, b, o_lat.stride(0), o_lat.stride(1), w_uv.stride(0), w_uv.stride(1),
        out.stride(0), out.stride(1), C=c, DV=dv, CP=triton.next_power_of_2(c),
        BLOCK_D=BLOCK_D, ROWS=ROWS, PDL=pdl, num_warps=8, launch_pdl=pdl)
    return out
