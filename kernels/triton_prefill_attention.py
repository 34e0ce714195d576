"""Triton prefill attention over the paged KV cache: ragged chunked prefill, causal, GQA.

Every key and value comes from the cache (``store_kv`` for the chunk runs first), so a chunk
of ``n`` queries after ``seq_len - n`` cached tokens is one case: query ``j`` sits at
position ``seq_len - n + j`` and sees keys ``0 .. seq_len - n + j``. One program owns
(query head, ``BLOCK_M`` queries of one request). Its key loop has an unmasked part (keys
every query of the tile sees) and a masked part near the diagonal, so only the last one or
two tiles pay for the causal mask. See ref_attention.prefill_attention_ref for the contract.

Host syncs: none. The grid is sized from shapes alone: request ``b``'s query tiles take the
slots ``cu[b] // BLOCK_M + b ...``, which never overlap and fit in ``T // BLOCK_M + B``
slots, and each program finds its request by binary search over ``cu_seqlens_q``. A
request's spare slot (at most one each) exits at once.

Split-K (``SPLIT``, kernels/triton_prefill_split.py): a third grid dimension splits each
tile's keys ``[0, hi)`` into ``S`` even runs of whole key tiles. The run holding ``diag``
takes the masked part whole, up to ``hi``, and the runs after it have nothing left, so
every split sees either only keys below the tile's first query (all its rows see them all)
or the diagonal, whose first key every row sees: no row of a split that has keys is fully
masked. Each split writes a float32 partial and its log-sum-exp, which a merge kernel
combines; a split with no keys writes lse -inf (weight 0).

Fixed grid (``fixed_grid``, CUDA graphs of short prefill steps, engine/prefill_graphs.py):
a graph replays the launch it captured, so nothing may depend on host-side lengths. The
split count comes from the block table's capacity, and each tile spreads its own keys over
those splits on the device, at least MIN_SPLIT_KEYS a split (a short context uses one); a
split after the one holding the diagonal has no keys and exits after writing lse -inf,
which the merge reads without loading its partial output. Tokens after ``cu[B]`` are the
graph's padding rows: the last request's slots reach row ``T - 1`` and write them zeros
without walking any key.

A float8 cache is upcast on load to the query's dtype; its K scale folds into the softmax
scale and its V scale multiplies the output (kernels/kv_fp8.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.tile_fit import Tiles, fit_attention_tiles, launch_fitting
from kernels.triton_common import (
    check,
    check_device,
    check_float,
    check_int,
    check_kv,
    check_paged_qkv,
    check_shape,
    kv_compute_dtype,
    kv_ieee,
)
from kernels.triton_prefill_split import (
    MIN_SPLIT_KEYS,
    choose_prefill_splits,
    max_query_tiles,
    merge_splits,
    partials,
)
from kernels.triton_query_tiles import request_of_slot

LOG2E = 1.4426950408889634

# Tuned on an H200 for bf16 (bench/kernels_bench.py); the launcher's keyword arguments
# override them, and tile_fit shrinks them where a dtype or head dim would not fit.
BLOCK_M = 256
BLOCK_N = 64
NUM_WARPS = 8
NUM_STAGES = 3
# Steps of at most SHORT_BLOCK_M tokens (a short chunk, e.g. after a cached prefix) use
# query tiles of this size with SHORT_NUM_WARPS: a 256-row tile would leave half its rows
# padding. 8 warps, not 4: at 4 the [128, 128] float32 accumulator spills 2.7 KB of
# registers (ptxas for sm_90, D 128), at 8 80 bytes. Callers that pass block_m /
# num_warps get what they ask for.
SHORT_BLOCK_M = 128
SHORT_NUM_WARPS = 8


@triton.jit
def _attend_tile(acc, m, lsum, q, kv_head, bt_row, s_cb, s_ckv, s_cs, qk_scale, qpos,
                 lo, hi, seq_len,
                 D: tl.constexpr, BS: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr,
                 COMPUTE: tl.constexpr, IEEE: tl.constexpr):
    """Online softmax over keys [lo, hi): accumulates into (acc, m, lsum) and returns them."""
    d = tl.arange(0, D)
    for n0 in range(lo, hi, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)  # [BLOCK_N] key positions
        if MASKED:
            nmask = n < seq_len
            blk = tl.load(bt_row + n // BS, mask=nmask, other=0).to(tl.int64)
        else:
            blk = tl.load(bt_row + n // BS).to(tl.int64)
        row = kv_head + blk * s_cb + (n % BS) * s_cs  # [BLOCK_N]
        if MASKED:
            k = tl.load(row[:, None] + d[None, :], mask=nmask[:, None], other=0.0)
            v = tl.load(row[:, None] + s_ckv + d[None, :], mask=nmask[:, None], other=0.0)
        else:
            k = tl.load(row[:, None] + d[None, :])  # [BLOCK_N, D]
            v = tl.load(row[:, None] + s_ckv + d[None, :])
        k = k.to(COMPUTE)
        v = v.to(COMPUTE)
        if IEEE:
            s = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))  # [BLOCK_M, BLOCK_N], unscaled
        if MASKED:
            s = tl.where((n[None, :] <= qpos[:, None]) & (n[None, :] < seq_len), s,
                         float("-inf"))
        # Finite: each row's first tile holds key 0, which every row sees.
        m_new = tl.maximum(m, tl.max(s, axis=1) * qk_scale)  # log2 domain
        alpha = tl.exp2(m - m_new)
        p = tl.exp2(s * qk_scale - m_new[:, None])  # one FMA per score
        lsum = lsum * alpha + tl.sum(p, axis=1)
        if IEEE:
            acc = acc * alpha[:, None] + tl.dot(p.to(COMPUTE), v, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(COMPUTE), v)
        m = m_new
    return acc, m, lsum


# A step's request count, token count and block-table width change from step to step:
# specialized (== 1, divisible by 16), each value class is another compile of this kernel,
# ~1.5-2.7 s on an H200 in the middle of serving (engine/compile_watch.py named them), times
# every tile / split variant. Left unspecialized, the variants are the constexprs alone,
# which the start-up warm-up (engine/warmup.py) runs. They feed only scalar address
# arithmetic and loop bounds.
@triton.jit(do_not_specialize=["s_btb", "num_reqs", "search_steps", "num_tokens"])
def _prefill_kernel(
    q_ptr, kv_ptr, bt_ptr, cu_ptr, lens_ptr, out_ptr, part_o_ptr, part_lse_ptr,
    s_qt, s_qh,  # q strides [T, Hq, D]; D is contiguous
    s_cb, s_ckv, s_cs, s_ch,  # kv_layer strides [NB, 2, BS, Hkv, D]; D is contiguous
    s_btb,
    s_ot, s_oh,
    qk_scale,  # softmax scale * log2(e) (* a float8 cache's K scale)
    v_scale,  # a float8 cache's V scale (1.0 otherwise): multiplies the output
    num_reqs, search_steps,  # B, and ceil(log2(B + 1)) binary-search steps
    num_tokens,  # T: SPLIT's partials are [S, T, Hq, D] and [S, T, Hq] float32
    G: tl.constexpr, D: tl.constexpr, BS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, COMPUTE: tl.constexpr, IEEE: tl.constexpr,
    SPLIT: tl.constexpr,
    FIXED: tl.constexpr,  # a fixed-grid launch (see the module docstring)
    LEAST: tl.constexpr,  # FIXED and SPLIT: the least keys a split run holds (BLOCK_N's)
):
    hq = tl.program_id(0)  # fastest: the heads of one tile run together and share KV in L2
    slot = tl.num_programs(1) - 1 - tl.program_id(1)  # last requests' last tiles first
    # the request owning this slot, and the slot's query tile within its chunk
    b, q_start, n_q, mt = request_of_slot(cu_ptr, slot, num_reqs, search_steps, BLOCK_M)
    if FIXED:
        # rows this program writes: the last request's run on to row T - 1 (padding)
        n_rows = tl.where(b == num_reqs - 1, num_tokens - q_start, n_q)
    else:
        n_rows = n_q
    if mt * BLOCK_M >= n_rows:
        return
    seq_len = tl.load(lens_ptr + b)
    ctx = seq_len - n_q  # cached tokens before this chunk

    mi = mt * BLOCK_M + tl.arange(0, BLOCK_M)  # [BLOCK_M] query index within the chunk
    d = tl.arange(0, D)
    mmask = mi < n_q
    wmask = mi < n_rows  # == mmask unless FIXED: padding rows are written too
    tok = (q_start + mi).to(tl.int64)
    q = tl.load(q_ptr + tok[:, None] * s_qt + hq * s_qh + d[None, :], mask=mmask[:, None],
                other=0.0).to(COMPUTE)  # [BLOCK_M, D]
    qpos = ctx + mi

    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    lsum = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D], tl.float32)
    kv_head = kv_ptr + (hq // G) * s_ch  # small: Hkv * D
    bt_row = bt_ptr + b * s_btb
    # Keys below the tile's first query position are visible to all its queries.
    diag = (ctx + mt * BLOCK_M) // BLOCK_N * BLOCK_N
    hi = tl.minimum(seq_len, ctx + (mt + 1) * BLOCK_M)
    if SPLIT:
        # This split's run of whole key tiles; the run holding diag also takes [diag, hi).
        split = tl.program_id(2)
        run = tl.cdiv(tl.cdiv(hi, tl.num_programs(2)), BLOCK_N) * BLOCK_N
        if FIXED:
            run = tl.maximum(run, LEAST)
        lo = split * run
        plain_hi = tl.minimum(lo + run, diag)  # < lo (nothing) for runs past diag
        masked_lo = tl.where((lo <= diag) & (diag < lo + run), diag, hi)
    else:
        lo = 0
        plain_hi = diag
        masked_lo = diag
    if FIXED:
        # No work: a tile of padding rows only, or a split past the diagonal's run.
        idle = mt * BLOCK_M >= n_q
        if SPLIT:
            idle = idle | (lo > diag)
        if idle:
            if SPLIT:  # weight 0 in the merge, which then skips this partial output
                row = (split * num_tokens + tok) * tl.num_programs(0) + hq
                tl.store(part_lse_ptr + row, tl.full([BLOCK_M], float("-inf"), tl.float32),
                         mask=wmask)
            else:
                tl.store(out_ptr + tok[:, None] * s_ot + hq * s_oh + d[None, :],
                         tl.zeros([BLOCK_M, D], out_ptr.dtype.element_ty),
                         mask=wmask[:, None])
            return
    acc, m, lsum = _attend_tile(acc, m, lsum, q, kv_head, bt_row, s_cb, s_ckv, s_cs, qk_scale,
                                qpos, lo, plain_hi, seq_len, D, BS, BLOCK_N, False, COMPUTE,
                                IEEE)
    acc, m, lsum = _attend_tile(acc, m, lsum, q, kv_head, bt_row, s_cb, s_ckv, s_cs, qk_scale,
                                qpos, masked_lo, hi, seq_len, D, BS, BLOCK_N, True, COMPUTE,
                                IEEE)
    if SPLIT:
        # A split with no keys has lsum 0 (every row, or none: see the module docstring).
        seen = lsum > 0.0
        if FIXED:
            seen = seen & mmask  # a padding row (it saw every key) weighs 0
        o = acc / tl.where(seen, lsum, 1.0)[:, None] * v_scale
        lse = tl.where(seen, m + tl.log2(tl.where(seen, lsum, 1.0)), float("-inf"))
        row = (tl.program_id(2) * num_tokens + tok) * tl.num_programs(0) + hq  # [BLOCK_M]
        tl.store(part_o_ptr + row[:, None] * D + d[None, :], o, mask=mmask[:, None])
        tl.store(part_lse_ptr + row, lse, mask=wmask)
    else:
        o = acc / lsum[:, None] * v_scale  # x 1.0 (not a float8 cache) is exact
        if FIXED:
            o = tl.where(mmask[:, None], o, 0.0)
        tl.store(out_ptr + tok[:, None] * s_ot + hq * s_oh + d[None, :],
                 o.to(out_ptr.dtype.element_ty), mask=wmask[:, None])


def prefill_attention(
    q: torch.Tensor,  # [T, Hq, D]: the queries of every request's current chunk, packed
    kv_layer: torch.Tensor,  # [NB, 2, BS, Hkv, D]
    block_tables: torch.Tensor,  # [B, max_blocks] int32
    cu_seqlens_q: torch.Tensor,  # [B + 1] int32: request b's queries are q[cu[b]:cu[b+1]]
    seq_lens: torch.Tensor,  # [B] int32: context length after this chunk (cached + chunk)
    scale: float,
    out: torch.Tensor | None = None,  # [T, Hq, D]
    *,
    max_seq_len: int | None = None,  # host-side bound on seq_lens; sizes the key splits
    num_splits: int | None = None,  # key splits per query tile; None: choose_prefill_splits
    block_m: int | None = None,  # None: BLOCK_M, or SHORT_BLOCK_M for a short step
    block_n: int = BLOCK_N,
    num_warps: int | None = None,  # None: NUM_WARPS, or SHORT_NUM_WARPS for a short step
    num_stages: int = NUM_STAGES,
    k_scale: float = 1.0,  # float8 cache: this layer's K and V scales
    v_scale: float = 1.0,
    # A CUDA graph's launch: splits from the table's capacity and tokens after cu[B]
    # written as zeros (see the module docstring); needs max_seq_len None.
    fixed_grid: bool = False,
) -> torch.Tensor:
    hq, hkv, bs = check_paged_qkv(q, kv_layer, "[T, Hq, D]")
    num_tokens, d = q.shape[0], q.shape[2]
    check(block_tables.dim() == 2, "block_tables: expected [B, max_blocks]")
    bsz = block_tables.shape[0]
    check_shape("cu_seqlens_q", cu_seqlens_q, (bsz + 1,))
    check_shape("seq_lens", seq_lens, (bsz,))
    check_float("q", q)
    check_kv("kv_layer", kv_layer)
    for name, t in (("block_tables", block_tables), ("cu_seqlens_q", cu_seqlens_q),
                    ("seq_lens", seq_lens)):
        check_int(name, t)
    check(q.stride(2) == 1 and kv_layer.stride(4) == 1, "q, kv_layer: head_dim must be contiguous")
    check(block_tables.stride(1) == 1, "block_tables: rows must be contiguous")
    if out is None:
        out = torch.empty_like(q)
    check_shape("out", out, q.shape)
    check(out.stride(2) == 1, "out: head_dim must be contiguous")
    check_device(q, kv_layer, block_tables, cu_seqlens_q, seq_lens, out)
    if num_splits is not None:
        check(1 <= num_splits < 65536, f"num_splits: must be in [1, 65535], got {num_splits}")
    check(not (fixed_grid and max_seq_len is not None),
          "max_seq_len: a fixed-grid launch sizes its splits from the block table alone")
    if bsz == 0 or num_tokens == 0:
        return out
    short = num_tokens <= SHORT_BLOCK_M
    if block_m is None:
        block_m = SHORT_BLOCK_M if short else BLOCK_M
    if num_warps is None:
        num_warps = SHORT_NUM_WARPS if short else NUM_WARPS
    want = fit_attention_tiles(Tiles(block_m, block_n, num_stages, num_warps), d,
                               kv_layer.dtype, q.device)
    if num_splits is None:
        if max_seq_len is None:
            max_seq_len = block_tables.shape[1] * bs
        num_splits = choose_prefill_splits(max_query_tiles(num_tokens, bsz, want.block_m), hq,
                                           max_seq_len, q.device)
    split = num_splits > 1
    if split:
        part_o, part_lse = partials(num_splits, num_tokens, hq, d, q.device)
    else:
        part_o = part_lse = out  # unused

    def launch(t: Tiles) -> None:
        check(num_tokens // t.block_m + bsz < 65536, "too many query tiles for grid dim 1")
        grid = (hq, num_tokens // t.block_m + bsz, num_splits)
        _prefill_kernel[grid](
            q, kv_layer, block_tables, cu_seqlens_q, seq_lens, out, part_o, part_lse,
            q.stride(0), q.stride(1),
            kv_layer.stride(0), kv_layer.stride(1), kv_layer.stride(2), kv_layer.stride(3),
            block_tables.stride(0),
            out.stride(0), out.stride(1),
            scale * LOG2E * k_scale, float(v_scale), bsz, bsz.bit_length(), num_tokens,
            G=hq // hkv, D=d, BS=bs, BLOCK_M=t.block_m, BLOCK_N=t.block_n,
            COMPUTE=kv_compute_dtype(q, kv_layer), IEEE=kv_ieee(q, kv_layer), SPLIT=split,
            FIXED=fixed_grid, LEAST=triton.cdiv(MIN_SPLIT_KEYS, t.block_n) * t.block_n,
            num_warps=t.num_warps, num_stages=t.num_stages,
        )

    launch_fitting(("prefill", kv_layer.dtype, d, q.device), want, launch)
    if split:
        merge_splits(part_o, part_lse, out, num_splits, skip_empty=fixed_grid)
    return out
