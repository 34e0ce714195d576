"""The merge of split-K decode attention's partials (kernels/triton_decode_attention.py):
each split's [B, Hq, S, D] output and [B, Hq, S] log-sum-exp (log2 domain) are combined by
their log-sum-exp, either in the last split program of a (request, KV head) to finish
(merge_if_last: no second kernel, whose launch and gap cost more than the merge at small
batches) or by merge_kernel over every query head."""

from __future__ import annotations

import triton
import triton.language as tl

from kernels.pdl import follow
from kernels.triton_split_len import request_splits_holding, splits_holding


@triton.jit
def merge_if_last(part_o_ptr, part_lse_ptr, out_ptr, cnt_ptr, b, kvh, seq_len, split_len,
                  s_ob, s_oh, num_splits, G: tl.constexpr, D: tl.constexpr,
                  G_PAD: tl.constexpr, MERGE_S: tl.constexpr):
    """Called by every split program of (request b, KV head kvh) that holds tokens, after its
    partial stores:
    the last to arrive merges them all into out. split_len is the request's own split size
    (triton_split_len.split_range's), from which the splits that hold tokens are counted.
    The barrier orders every thread's partial stores before the counter's release; the
    acquire orders the merger's loads after the others'."""
    tl.debug_barrier()
    used = splits_holding(seq_len, split_len, num_splits)
    cnt = cnt_ptr + b * tl.num_programs(1) + kvh
    if tl.atomic_add(cnt, 1, sem="acq_rel", scope="gpu") == used - 1:
        tl.store(cnt, 0)  # zero again for the next launch (or graph replay)
        merge_group(part_o_ptr, part_lse_ptr, out_ptr, b, kvh * G, s_ob, s_oh, num_splits,
                    used, G, D, G_PAD, MERGE_S)


@triton.jit
def merge_group(part_o_ptr, part_lse_ptr, out_ptr, b, h0, s_ob, s_oh, num_splits, used,
                G: tl.constexpr, D: tl.constexpr, G_PAD: tl.constexpr, MERGE_S: tl.constexpr):
    """Merges the first `used` splits of q heads h0 .. h0+G-1 of request b, MERGE_S at a time
    (an online log-sum-exp across chunks), into out. Loads bypass L1 (.cg): the other
    programs' partials were written through L2."""
    g = tl.arange(0, G_PAD)
    sp = tl.arange(0, MERGE_S)
    d = tl.arange(0, D)
    rows = (b * tl.num_programs(1) * G + h0 + g).to(tl.int64) * num_splits  # [G_PAD]
    mx = tl.full([G_PAD], float("-inf"), tl.float32)
    wsum = tl.zeros([G_PAD], tl.float32)
    acc = tl.zeros([G_PAD, D], tl.float32)
    for s0 in range(0, used, MERGE_S):
        idx = rows[:, None] + s0 + sp[None, :]  # [G_PAD, MERGE_S]
        mask = (g[:, None] < G) & (s0 + sp[None, :] < used)
        lse = tl.load(part_lse_ptr + idx, mask=mask, other=float("-inf"), cache_modifier=".cg")
        o = tl.load(part_o_ptr + idx[:, :, None] * D + d[None, None, :], mask=mask[:, :, None],
                    other=0.0, cache_modifier=".cg")  # [G_PAD, MERGE_S, D]
        mx_new = tl.maximum(mx, tl.max(lse, axis=1))
        safe = tl.where(mx_new == float("-inf"), 0.0, mx_new)  # padded head rows
        scale = tl.exp2(mx - safe)
        w = tl.exp2(lse - safe[:, None])  # [G_PAD, MERGE_S]; masked splits weigh 0
        wsum = wsum * scale + tl.sum(w, axis=1)
        acc = acc * scale[:, None] + tl.sum(o * w[:, :, None], axis=1)
        mx = mx_new
    res = acc / tl.where(wsum > 0.0, wsum, 1.0)[:, None]
    tl.store(out_ptr + b * s_ob + (h0 + g)[:, None] * s_oh + d[None, :],
             res.to(out_ptr.dtype.element_ty), mask=(g < G)[:, None])


@triton.jit
def merge_kernel(
    part_o_ptr, part_lse_ptr, out_ptr, lens_ptr,
    s_ob, s_oh,
    split_len,  # as the decode kernel's (DYN: the least tokens per split)
    num_splits,
    D: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_N: tl.constexpr, DYN: tl.constexpr,
    PDL: tl.constexpr,
):
    if PDL:
        follow()
    b = tl.program_id(0)
    h = tl.program_id(1)
    used = request_splits_holding(lens_ptr, b, split_len, num_splits, BLOCK_N, DYN)
    sp = tl.arange(0, BLOCK_S)
    d = tl.arange(0, D)
    smask = sp < used
    base = (b * tl.num_programs(1) + h).to(tl.int64) * num_splits
    lse = tl.load(part_lse_ptr + base + sp, mask=smask, other=float("-inf"))  # [BLOCK_S]
    mx = tl.max(lse, axis=0)
    w = tl.exp2(lse - tl.where(mx == float("-inf"), 0.0, mx))  # masked splits weigh 0
    o = tl.load(part_o_ptr + (base + sp)[:, None] * D + d[None, :], mask=smask[:, None],
                other=0.0)  # [BLOCK_S, D]
    wsum = tl.sum(w, axis=0)
    res = tl.sum(o * w[:, None], axis=0) / tl.where(wsum > 0.0, wsum, 1.0)
    tl.store(out_ptr + b * s_ob + h * s_oh + d, res.to(out_ptr.dtype.element_ty))
