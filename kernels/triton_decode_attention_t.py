"""GQA decode attention over a float8 cache in the transposed form: the same contract, grid,
splits, partials and merge as kernels/triton_decode_attention.py, which launches it instead
of its own kernel for a float8 cache where ``triton_decode_attention.FP8_FORM`` is
"transposed".

Why: a KV head's query group (4 heads at Llama-3-8B's 32/8) is padded to a 16-row tile, so
the products ``q [16, D] @ K^T`` and ``p [16, N] @ V`` are under the 64 rows Hopper's
warpgroup MMA (wgmma) needs and run on ``mma.sync``, both operands in registers. The
float8 tiles are widened to fp16 in registers, then rearranged for the products, and that
per-tile work bounds the kernel on an H200 at 0.63-0.68x bf16 KV's time where its bytes
are 0.5x (bench/RESULTS.md, "FP8 KV decode splits by waves"). Here the tokens are the
rows: ``s^T = K [BLOCK_N, D] @ q^T [D, 16]`` and ``o^T = V^T [D, BLOCK_N] @ p^T [BLOCK_N,
16]``, both warpgroup MMAs (64-token tiles, one warpgroup) whose widened K is an operand
straight from registers; N = 16 query columns, the padded group.

The softmax runs down the columns (one per query head). Partials are stored in the same
[B, Hq, S, D] layout, so kernels/triton_decode_merge.py merges either form's.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.pdl import follow
from kernels.triton_decode_merge import merge_if_last
from kernels.triton_split_len import split_range

# Tiles (module constants, so a benchmark variant can set each): tokens per tile (64: a
# warpgroup MMA's least rows), warps (4: one warpgroup), pipeline stages, and the programs
# an SM holds at once, which sizes the split count as FP8_RESIDENT_PER_SM does for the
# pointer form.
BLOCK_N = 64
NUM_WARPS = 4
NUM_STAGES = 2
RESIDENT_PER_SM = 3


@triton.jit
def _decode_t_kernel(
    q_ptr, kv_ptr, bt_ptr, lens_ptr, out_ptr, part_o_ptr, part_lse_ptr, cnt_ptr,
    s_qb, s_qh,  # q strides [B, Hq, D]; D is contiguous
    s_cb, s_ckv, s_cs, s_ch,  # kv_layer strides [NB, 2, BS, Hkv, D]; D is contiguous
    s_btb,  # block_tables row stride
    s_ob, s_oh,  # out strides [B, Hq, D]; D is contiguous
    qk_scale,  # softmax scale * log2(e) * the cache's K scale: log2-domain scores
    v_scale,  # the cache's V scale: multiplies the output
    split_len,  # tokens per split, a multiple of BLOCK_N (DYN: the least tokens per split)
    num_splits,
    G: tl.constexpr, BLOCK_G: tl.constexpr, D: tl.constexpr, BS: tl.constexpr,
    BLOCK_N: tl.constexpr, SPLIT: tl.constexpr, COMPUTE: tl.constexpr, PREC: tl.constexpr,
    DYN: tl.constexpr, FUSED: tl.constexpr, G_PAD: tl.constexpr, MERGE_S: tl.constexpr,
    ROUND: tl.constexpr, CLAMP_Q: tl.constexpr, PDL: tl.constexpr,
):
    if PDL:  # q is the kernel before's output; out may reuse its memory (kernels/pdl.py)
        follow()
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    # ROUND, not BLOCK_N: the merge must size the splits the same way; split_len is now
    # the request's own (DYN), which the fused merge counts its splits by
    seq_len, split_len, start, end = split_range(lens_ptr, b, split, split_len, num_splits,
                                                 ROUND, DYN)
    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, D)
    hq = kvh * G + g  # [BLOCK_G]: q heads sharing this KV head (SDPA's enable_gqa order)
    gmask = g < G
    if SPLIT:
        if start >= seq_len:  # the merge reads only the splits this request used
            if FUSED and split == 0:  # no context (a graph's padding row): zeros, as unsplit
                tl.store(out_ptr + b * s_ob + hq[None, :] * s_oh + d[:, None],
                         tl.zeros([D, BLOCK_G], out_ptr.dtype.element_ty), mask=gmask[None, :])
            return

    q_t = tl.load(q_ptr + b * s_qb + hq[None, :] * s_qh + d[:, None], mask=gmask[None, :],
                  other=0.0)  # [D, BLOCK_G]: a query head per column
    if CLAMP_Q:  # bf16 into fp16 products: a component past fp16's range would be inf
        q_t = tl.minimum(tl.maximum(q_t.to(tl.float32), -65504.0), 65504.0)
    q_t = q_t.to(COMPUTE)

    m = tl.full([BLOCK_G], float("-inf"), tl.float32)
    lsum = tl.zeros([BLOCK_G], tl.float32)
    acc_t = tl.zeros([D, BLOCK_G], tl.float32)
    kv_head = kv_ptr + kvh.to(tl.int64) * s_ch
    bt_row = bt_ptr + b.to(tl.int64) * s_btb
    for n0 in range(start, end, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)  # [BLOCK_N] token positions
        nmask = n < end
        blk = tl.load(bt_row + n // BS, mask=nmask, other=0).to(tl.int64)
        row = kv_head + blk * s_cb + (n % BS) * s_cs  # [BLOCK_N] pointers to each token's K
        k = tl.load(row[:, None] + d[None, :], mask=nmask[:, None], other=0.0).to(COMPUTE)
        v = tl.load(row[:, None] + s_ckv + d[None, :], mask=nmask[:, None],
                    other=0.0).to(COMPUTE)  # [BLOCK_N, D]
        s_t = tl.dot(k, q_t, input_precision=PREC)  # [BLOCK_N, BLOCK_G], unscaled
        s_t = tl.where(nmask[:, None], s_t, float("-inf"))
        m_new = tl.maximum(m, tl.max(s_t, axis=0) * qk_scale)  # finite: a valid token per tile
        alpha = tl.exp2(m - m_new)
        p_t = tl.exp2(s_t * qk_scale - m_new[None, :])  # one FMA per score
        lsum = lsum * alpha + tl.sum(p_t, axis=0)
        acc_t = acc_t * alpha[None, :] + tl.dot(tl.trans(v), p_t.to(COMPUTE),
                                                input_precision=PREC)  # [D, BLOCK_G]
        m = m_new

    o_t = acc_t * (v_scale / tl.where(lsum > 0.0, lsum, 1.0))[None, :]
    if SPLIT:
        part = (b * tl.num_programs(1) * G + hq).to(tl.int64) * num_splits + split  # [BLOCK_G]
        tl.store(part_o_ptr + part[None, :] * D + d[:, None], o_t, mask=gmask[None, :])
        lse = tl.where(lsum > 0.0, m + tl.log2(tl.maximum(lsum, 1e-30)), float("-inf"))
        tl.store(part_lse_ptr + part, lse, mask=gmask)
        if FUSED:  # the last of this (request, KV head)'s splits merges them all
            merge_if_last(part_o_ptr, part_lse_ptr, out_ptr, cnt_ptr, b, kvh, seq_len,
                          split_len, s_ob, s_oh, num_splits, G, D, G_PAD, MERGE_S)
    else:
        tl.store(out_ptr + b * s_ob + hq[None, :] * s_oh + d[:, None],
                 o_t.to(out_ptr.dtype.element_ty), mask=gmask[None, :])


def fits(q: torch.Tensor, group: int) -> bool:
    """Whether the transposed form takes this call: a query group of at most 16 heads (the
    products' N) and a head size of at least 16 (their K)."""
    return group <= 16 and q.shape[2] >= 16


def launch(grid: tuple[int, int, int], args: tuple, *, g: int, d: int, bs: int,
           split: bool, compute: object, ieee: bool, dyn: bool, fused: bool, merge_s: int,
           round_n: int, clamp_q: bool, pdl: bool, num_warps: int, num_stages: int) -> None:
    """Launches the kernel with the pointer form's arguments (triton_decode_attention's
    launch: tensors, strides, scales and split sizes, in its kernel's order) and this form's
    tiles (the warps and stages as the caller gives them); round_n is the block size the
    split lengths are whole multiples of."""
    _decode_t_kernel[grid](
        *args, G=g, BLOCK_G=16, D=d, BS=bs, BLOCK_N=BLOCK_N, SPLIT=split, COMPUTE=compute,
        PREC="ieee" if ieee else None, DYN=dyn, FUSED=fused,
        G_PAD=triton.next_power_of_2(g), MERGE_S=merge_s, ROUND=round_n, CLAMP_Q=clamp_q,
        PDL=pdl, num_warps=num_warps, num_stages=num_stages, launch_pdl=pdl,
    )
