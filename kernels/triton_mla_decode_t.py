"""Paged MLA decode in the transposed form: the same contract, splits and merge as
kernels/triton_mla_decode.py, whose pointer form it replaces where ``triton_mla_decode.FORM``
is "transposed".

Why: at DeepSeek-V2-Lite's 16 query heads the pointer form's products are [16 heads x
tokens] tiles, under the 64 rows Hopper's warpgroup MMA (wgmma) needs, so they run on
``mma.sync`` with every operand in registers: 210 registers a thread hold an SM to two
4-warp programs, and each program streams the cache at about 9 GB/s on an H100 and an
H200 alike (bench/RESULTS.md, "MLA decode with each page loaded by the copy engine"), so
the H200's faster memory goes unused. Here the tokens are the rows: the scores are
``s^T = latent [BLOCK_N, C] @ q^T [C, H]`` and the output ``o^T = latent^T [C, BLOCK_N] @
p^T [BLOCK_N, H]``. With BLOCK_N = 64 both products are warpgroup MMAs whose latent operand
is read where the pipeline's copies left it, in shared memory: no operand registers, the
products asynchronous, and a 64-token tile a step (about 73 KB), one program an SM.

Tokens are gathered per row as in the pointer form (tiles may cross pages). C and R are
padded to powers of two and masked as there. Compiled for sm_90 (tests/kernels/
test_mla_decode_t_sm90.py) its products are wgmma and nothing spills at a 16-bit cache. A
float8 cache keeps the pointer form: its 64-token tiles, widened in registers for the
products, spilled 0.2-1 KB at 4, 8 and 16 warps.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.pdl import follow
from kernels.triton_split_len import head_block_split

# Tiles (module constants so a benchmark variant can set each one): tokens per tile (64:
# a warpgroup MMA's least rows), warps, pipeline stages, and the programs an SM holds (one:
# two 64-token tile buffers are ~168 KB of shared memory at DeepSeek's 512 + 64, bf16).
BLOCK_N = 64
NUM_WARPS = 8
NUM_STAGES = 2
PROGRAMS_PER_SM = 1


@triton.jit
def _mla_decode_t_kernel(
    q_ptr, kv_ptr, bt_ptr, lens_ptr, out_ptr, part_o_ptr, part_lse_ptr,
    s_qb, s_qh,  # q strides [B, H, C + R]; the last dim is contiguous
    s_cb, s_cs,  # kv_layer strides of the block and the token [NB, 1, BS, 1, C + R]
    s_btb,  # block_tables row stride
    s_ob, s_oh,  # out strides [B, H, C]
    qk_scale,  # softmax scale * log2(e) (* a float8 cache's scale): log2-domain scores
    v_scale,  # a float8 cache's scale (1.0 otherwise): multiplies the output
    split_len,  # tokens per split, a multiple of BLOCK_N (DYN: the least per split)
    num_splits, H,
    C: tl.constexpr, R: tl.constexpr, CP: tl.constexpr, RP: tl.constexpr,
    BLOCK_H: tl.constexpr, BS: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT: tl.constexpr,
    COMPUTE: tl.constexpr, PREC: tl.constexpr, DYN: tl.constexpr, PDL: tl.constexpr,
):
    if PDL:  # q is the kernel before's output; out may reuse its memory (kernels/pdl.py)
        follow()
    b, split, seq_len, start, end, h, hmask = head_block_split(
        lens_ptr, split_len, num_splits, H, BLOCK_H, BLOCK_N, DYN)  # h: [BLOCK_H] query heads
    if SPLIT:
        if start >= seq_len:  # the merge reads only the splits this request used
            return
    c = tl.arange(0, CP)
    cmask = c < C
    r = tl.arange(0, RP)
    rmask = r < R
    q_col = q_ptr + b.to(tl.int64) * s_qb + h[None, :] * s_qh  # [1, BLOCK_H]
    q_cT = tl.load(q_col + c[:, None], mask=cmask[:, None] & hmask[None, :],
                   other=0.0).to(COMPUTE)  # [CP, BLOCK_H]
    q_rT = tl.load(q_col + C + r[:, None], mask=rmask[:, None] & hmask[None, :],
                   other=0.0).to(COMPUTE)  # [RP, BLOCK_H]

    m = tl.full([BLOCK_H], float("-inf"), tl.float32)
    lsum = tl.zeros([BLOCK_H], tl.float32)
    o_t = tl.zeros([CP, BLOCK_H], tl.float32)
    bt_row = bt_ptr + b.to(tl.int64) * s_btb
    for n0 in range(start, end, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)  # [BLOCK_N] token positions
        nmask = n < end
        blk = tl.load(bt_row + n // BS, mask=nmask, other=0).to(tl.int64)
        row = kv_ptr + blk * s_cb + (n % BS) * s_cs  # [BLOCK_N] each token's latent row
        lat = tl.load(row[:, None] + c[None, :], mask=nmask[:, None] & cmask[None, :],
                      other=0.0).to(COMPUTE)  # [BLOCK_N, CP]: key (nope part) and value
        kpe = tl.load(row[:, None] + C + r[None, :], mask=nmask[:, None] & rmask[None, :],
                      other=0.0).to(COMPUTE)  # [BLOCK_N, RP]
        s_t = tl.dot(lat, q_cT, input_precision=PREC)
        s_t = tl.dot(kpe, q_rT, s_t, input_precision=PREC)  # [BLOCK_N, BLOCK_H], unscaled
        s_t = tl.where(nmask[:, None], s_t * qk_scale, float("-inf"))
        m_new = tl.maximum(m, tl.max(s_t, axis=0))  # finite: a valid token per tile
        alpha = tl.exp2(m - m_new)
        p_t = tl.exp2(s_t - m_new[None, :])
        lsum = lsum * alpha + tl.sum(p_t, axis=0)
        o_t = o_t * alpha[None, :] + tl.dot(tl.trans(lat), p_t.to(COMPUTE),
                                              input_precision=PREC)
        m = m_new

    o_t = o_t * (v_scale / tl.where(lsum > 0.0, lsum, 1.0))[None, :]  # no context: zeros
    if SPLIT:
        part = (b * H + h).to(tl.int64) * num_splits + split  # [BLOCK_H]
        tl.store(part_o_ptr + part[None, :] * CP + c[:, None], o_t, mask=hmask[None, :])
        lse = tl.where(lsum > 0.0, m + tl.log2(tl.maximum(lsum, 1e-30)), float("-inf"))
        tl.store(part_lse_ptr + part, lse, mask=hmask)
    else:
        tl.store(out_ptr + b * s_ob + h[None, :] * s_oh + c[:, None],
                 o_t.to(out_ptr.dtype.element_ty), mask=cmask[:, None] & hmask[None, :])


def launch(q: torch.Tensor, kv_layer: torch.Tensor, block_tables: torch.Tensor,
           seq_lens: torch.Tensor, out: torch.Tensor, part_o: torch.Tensor,
           part_lse: torch.Tensor, qk_scale: float, v_scale: float, split_len: int,
           num_splits: int, c: int, cp: int, rp: int, block_h: int, block_n: int, split: bool,
           dyn: bool, compute: object, ieee: bool, pdl: bool, num_warps: int | None = None,
           num_stages: int | None = None) -> None:
    """Launches the kernel over (request, head block, split); the caller (mla_decode's
    unmerged step) sized the splits in whole tiles of block_n."""
    bsz, heads, width = q.shape
    _mla_decode_t_kernel[(bsz, triton.cdiv(heads, block_h), num_splits)](
        q, kv_layer, block_tables, seq_lens, out, part_o, part_lse,
        q.stride(0), q.stride(1), kv_layer.stride(0), kv_layer.stride(2),
        block_tables.stride(0), out.stride(0), out.stride(1),
        qk_scale, v_scale, split_len, num_splits, heads,
        C=c, R=width - c, CP=cp, RP=rp, BLOCK_H=block_h, BS=kv_layer.shape[2],
        BLOCK_N=block_n, SPLIT=split, COMPUTE=compute, PREC="ieee" if ieee else None,
        DYN=dyn, PDL=pdl, num_warps=NUM_WARPS if num_warps is None else num_warps,
        num_stages=NUM_STAGES if num_stages is None else num_stages, launch_pdl=pdl,
    )
