"""MLA decode's split merge inside its W_UV product, for a few rows: one launch for two.

At batch 1 a DeepSeek-V2-Lite decode step splits each layer's context over several
programs (kernels/triton_mla_decode.FEW_PROGRAMS_MIN_SPLIT_TOKENS), so MLA decode is two
kernels, the splits then their log-sum-exp merge into o_lat [B, H, C], and the W_UV
product that follows (kernels/triton_mla_absorb._up_kernel) is a third. In a CUDA graph at
one row each launch costs a few microseconds whatever it does, and a step is ~350 of
them: here the product's programs merge the row they multiply as they load it, and the
merge's own launch and o_lat's round trip through memory go.

A program owns (head, BLOCK_D value columns, ROWS rows), as ``_up_kernel``'s do. For each
row it merges that (request, head)'s splits with the merge kernel's own code
(triton_mla_decode._merge_row, so the arithmetic is one copy), rounds the result to the
model's dtype as o_lat's store did, and multiplies it by its [BLOCK_D, C] tile of W_UV:
the same numbers as merge + product, bit for bit. Each head's merge is redone by its
DV / BLOCK_D programs (four at V2-Lite's 128 values): 16 KB of float32 partials from L2 a
program at eight splits, against the 32 KB of weights it streams.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.pdl import follow, pdl_for
from kernels.triton_common import check, check_device
from kernels.triton_mla_absorb import BLOCK_D, ROWS, mla_up_v
from kernels.triton_mla_decode import UnmergedDecode, _merge_row


@triton.jit
def _up_merge_kernel(part_o_ptr, part_lse_ptr, lens_ptr, w_ptr, out_ptr, B, H, split_len,
                     num_splits, s_wh, s_wd, s_ob, s_oh,
                     C: tl.constexpr, DV: tl.constexpr, CP: tl.constexpr,
                     BLOCK_D: tl.constexpr, ROWS: tl.constexpr, MERGE_S: tl.constexpr,
                     BLOCK_N: tl.constexpr, DYN: tl.constexpr, PDL: tl.constexpr):
    """out[b, h, d] = sum_c round(merge(b, h))[c] * w[h, d, c]."""
    if PDL:  # the partials are the decode kernel's output (kernels/pdl.py)
        follow()
    h = tl.program_id(0)
    dv = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    b0 = tl.program_id(2) * ROWS
    cs = tl.arange(0, CP)
    cmask = cs < C
    dmask = dv < DV
    w = tl.load(w_ptr + h.to(tl.int64) * s_wh + dv[:, None] * s_wd + cs[None, :],
                mask=dmask[:, None] & cmask[None, :], other=0.0).to(tl.float32)  # [BD, CP]
    for r in tl.static_range(ROWS):
        b = b0 + r
        if b < B:
            x = _merge_row(part_o_ptr, part_lse_ptr, lens_ptr, b, h, H, split_len, num_splits,
                           CP, MERGE_S, BLOCK_N, DYN)
            # o_lat's rounding (the merge kernel stores the model's dtype); the partials'
            # padded columns past C are zeros, and w's are masked to zero as well
            x = x.to(out_ptr.dtype.element_ty).to(tl.float32)
            acc = tl.sum(w * x[None, :], axis=1)  # [BD]
            tl.store(out_ptr + b.to(tl.int64) * s_ob + h.to(tl.int64) * s_oh + dv,
                     acc.to(out_ptr.dtype.element_ty), mask=dmask)


def mla_up_v_merged(d: UnmergedDecode, seq_lens: torch.Tensor, w_uv: torch.Tensor,
                    out: torch.Tensor) -> torch.Tensor:
    """The W_UV product of kernels/triton_mla_decode.mla_decode_unmerged's result ``d``
    (per head: o_lat [B, H, C] @ w_uv[h]^T, w_uv [H, Dv, C]) -> out [B, H, Dv], merging
    the splits on the way where there are any. seq_lens: the decode call's."""
    b, h, c = d.out.shape
    check(w_uv.dim() == 3 and tuple(w_uv.shape[::2]) == (h, c),
          f"w_uv: expected [{h}, Dv, {c}], got {tuple(w_uv.shape)}")
    dv = w_uv.shape[1]
    check(tuple(out.shape) == (b, h, dv), f"out: expected {(b, h, dv)}, got {tuple(out.shape)}")
    check(w_uv.stride(-1) == 1 and out.stride(-1) == 1, "w_uv, out: last dim must be "
          "contiguous")
    check(out.dtype == d.out.dtype, f"out: expected {d.out.dtype} (o_lat's), got {out.dtype}")
    if d.part_o is None:  # one split: the decode kernel wrote o_lat itself
        return mla_up_v(d.out, w_uv, out)
    check_device(d.part_o, seq_lens, w_uv, out)
    pdl = pdl_for(out)
    _up_merge_kernel[(h, triton.cdiv(dv, BLOCK_D), triton.cdiv(b, ROWS))](
        d.part_o, d.part_lse, seq_lens, w_uv, out, b, h, d.split_len, d.num_splits,
        w_uv.stride(0), w_uv.stride(1), out.stride(0), out.stride(1),
        C=c, DV=dv, CP=d.cp, BLOCK_D=BLOCK_D, ROWS=ROWS, MERGE_S=d.merge_s,
        BLOCK_N=d.block_n, DYN=d.dyn, PDL=pdl, num_warps=8, launch_pdl=pdl)
    return out
