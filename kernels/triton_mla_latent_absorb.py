"""MLA decode's latent kernel and its W_UK product as one launch (horizontal fusion): the
programs of kernels/triton_mla_absorb.py's absorb product (q_nope @ W_UK into the absorbed
query's first C columns), then those of kernels/triton_mla_latent.py's latent kernel (the
latent's norm, RoPE and cache store; q_pe roped into the absorbed query's rope columns).

Both read the q / kv_a GEMM's output and write disjoint things, so nothing orders one
before the other; apart they are two launches per layer, each a few microseconds of fixed
latency in a batch-1 CUDA graph whatever its size (27 layers in DeepSeek-V2-Lite). Each
part is its kernel's own body (a jit helper, inlined), so the values are those the two
kernels write, bit for bit.

Reference: the two launchers, one after the other (mla_latent_store, then mla_absorb_q).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.pdl import follow, pdl_for
from kernels.triton_common import check
from kernels.triton_mla_absorb import absorb_body, absorb_q_launch
from kernels.triton_mla_latent import latent_launch, mla_latent_body

# The absorb product's warps (kernels/triton_mla_absorb.NUM_WARPS, 8), not the latent
# kernel's 4: its programs are most of the grid and of the time, and at 4 warps a program's
# [128, 128] float32 weight tile is 128 values a thread. The latent part pays a little: its
# rope tile and norm row spread over twice the threads, and the norm's sum crosses 8 warps,
# in T programs of a few KB each.
NUM_WARPS = 8


@triton.jit
def _latent_absorb_kernel(
    # the absorb part (absorb_body's arguments): q_nope, W_UK, the absorbed query's first
    # C columns, the rows, and their strides
    qn_ptr, wuk_ptr, qa_ptr, B, s_nb, s_nh, s_wh, s_wd, s_ab, s_ah,
    # the latent part (mla_latent_body's)
    kva_ptr, q_ptr, qo_ptr, w_ptr, pos_ptr, cs_ptr, kv_ptr, slot_ptr,
    s_a, s_qt, s_qh, s_ot, s_oh, s_cs, s_cb, s_ct, eps, scale,
    D: tl.constexpr, C: tl.constexpr, DP: tl.constexpr, BLOCK_C: tl.constexpr,
    ROWS: tl.constexpr, HALF: tl.constexpr, H: tl.constexpr, BS: tl.constexpr,
    CP: tl.constexpr, BLOCK_H: tl.constexpr, FP8: tl.constexpr, PDL: tl.constexpr,
):
    if PDL:  # q_nope, q and kv_a are the kernel before's output (kernels/pdl.py)
        follow()
    pid = tl.program_id(0)
    # The absorb programs first, the T latent ones after them: each absorb program streams a
    # [Dn, BLOCK_C] slice of W_UK from HBM (32 KB at V2-Lite's widths in bf16) where a latent
    # one moves a few KB, and a grid's blocks are dispatched about in order, so the long
    # ones start first and the short ones fill the SMs last (longest first). At V2-Lite
    # (64 + T programs) one wave holds them all anyway; at 128 heads on a rank it does not.
    # _absorb_kernel's grid (H, col blocks, row groups) flattened, heads fastest as there.
    NC: tl.constexpr = (C + BLOCK_C - 1) // BLOCK_C
    absorb_programs = H * NC * ((B + ROWS - 1) // ROWS)
    if pid < absorb_programs:
        absorb_body(qn_ptr, wuk_ptr, qa_ptr, B, s_nb, s_nh, s_wh, s_wd, s_ab, s_ah,
                    (pid % H).to(tl.int64), (pid // H) % NC, pid // (H * NC),
                    D, C, DP, BLOCK_C, ROWS)
    else:
        mla_latent_body(kva_ptr, q_ptr, qo_ptr, w_ptr, pos_ptr, cs_ptr, kv_ptr, slot_ptr,
                        s_a, s_qt, s_qh, s_ot, s_oh, s_cs, s_cb, s_ct, eps, scale,
                        (pid - absorb_programs).to(tl.int64), C, HALF, H, BS, CP, BLOCK_H,
                        FP8)


def mla_latent_absorb(
    kv_a: torch.Tensor,  # [T, C + R], rows contiguous
    q: torch.Tensor,  # [T, H, Dn + R], last dim contiguous
    norm_weight: torch.Tensor,  # [C]
    eps: float,
    positions: torch.Tensor,  # [T] int32/int64
    cos_sin: torch.Tensor,  # [max_pos, R] float32
    kv_layer: torch.Tensor,  # [NB, 1, BS, 1, C + R], a float or float8 cache
    slot_mapping: torch.Tensor,  # [T] int32/int64; < 0 skips the store
    q_nope: torch.Tensor,  # [T, H, Dn] (q's first Dn columns at decode)
    w_uk: torch.Tensor,  # [H, Dn, C]
    out: torch.Tensor,  # [T, H, C]: q_nope @ W_UK per head
    *,
    scale: float = 1.0,  # a float8 cache's scale (stores x / scale)
    q_pe_out: torch.Tensor | None = None,  # [T, H, R]; None: q's rope columns in place
) -> None:
    """mla_latent_store(kv_a, q, ..., scale=scale, q_pe_out=q_pe_out) and
    mla_absorb_q(q_nope, w_uk, out) in one launch, with their argument checks. The two
    parts run at once, so neither's outputs (out; kv_layer and q_pe_out or q's rope
    columns) may overlap the other's inputs, as at decode (out and q_pe_out are the
    absorbed query's two column ranges)."""
    lat = latent_launch(kv_a, q, norm_weight, eps, positions, cos_sin, kv_layer,
                        slot_mapping, scale, q_pe_out)
    ab = absorb_q_launch(q_nope, w_uk, out)
    h, c = lat.consts["H"], lat.consts["C"]
    check(ab.rows == lat.tokens and ab.heads == h,
          f"q_nope: expected q's [{lat.tokens}, {h}] tokens and heads, got {ab.rows}, {ab.heads}")
    check(ab.consts["C"] == c, f"w_uk: expected the latent's width {c}, got {ab.consts['C']}")
    if lat.tokens == 0:
        return
    pdl = pdl_for(kv_a)
    grid = ab.heads * ab.col_blocks * ab.row_groups + lat.tokens
    _latent_absorb_kernel[(grid,)](*ab.args, *lat.args, **{**lat.consts, **ab.consts},
                                   PDL=pdl, num_warps=NUM_WARPS, launch_pdl=pdl)
