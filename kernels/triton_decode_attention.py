"""Triton decode attention over the paged KV cache, split-K (flash-decoding), GQA.

One program owns (request, KV head, split): it loads that KV head's keys and values once
and scores all ``G = Hq / Hkv`` query heads that share them, so HBM traffic is the KV
bytes alone (the query group is padded to a 16-row tile for the tensor cores; decode is
memory bound, the wasted rows are free). Long contexts with few (request, KV head) pairs
are split along the sequence so the whole GPU streams KV; the last of a pair's split
programs to finish merges the splits by their log-sum-exp (a counter per pair; a small
second kernel instead when fused_merge is off). See ref_attention.decode_attention_ref for
the contract.

A float8 cache (kernels/kv_fp8.py) is read at half bf16's bytes and widened on load to fp16
(triton_common.kv_fp16_products), whatever the query's 16-bit dtype; its K scale folds into
the softmax scale and its V scale multiplies the output, so the inner loop does no extra
work per entry beyond the cast.

Host syncs: none. Without a ``max_seq_len`` hint (CUDA graphs, whose grid is fixed at
capture) the split count is sized for the block table's capacity and each request divides
its own context among those splits on the device: a short request uses few splits of at
least MIN_SPLIT_TOKENS, a long one all of them, evenly. The rest exit at once.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from kernels.pdl import follow, pdl_for
from kernels.tile_fit import Tiles, fit_attention_tiles, launch_fitting
from kernels.triton_common import (
    check,
    check_device,
    check_float,
    check_int,
    check_kv,
    check_paged_qkv,
    check_shape,
    is_fp8,
    kv_compute_dtype,
    kv_fp16_products,
    kv_ieee,
)
from kernels.triton_decode_merge import merge_if_last, merge_kernel
from kernels.triton_split_len import split_range
from kernels.waves import wave_splits

LOG2E = 1.4426950408889634

# Tile and launch defaults, tuned on an H200 (bench/kernels_bench.py); the launcher's
# keyword arguments override them.
BLOCK_N = 64  # KV tokens per inner-loop tile
NUM_WARPS = 4
NUM_STAGES = 4
# A float8 cache's own tiles: it reads half the bytes per tile, so the per-tile work (the
# casts, the softmax) must shrink with it. On an H200, Llama-3-8B heads, per layer, fp16
# products, bf16 KV's default tiles alongside (bench/fp8_kv_bench.py --sweep, 2026-12-03,
# bench/results/fp8_kv_sweep_h200.json): 64-key tiles at 2 warps and 2 stages were best or
# within 2% at every point; 8 programs per SM beat 16 at 64 x 4096 (0.166 against 0.185
# ms, bf16 KV 0.256) and tied elsewhere. bf16 KV's tiles with bf16 products took 1.07-1.13x
# bf16 KV's time (fp8_kv_h200.json).
FP8_BLOCK_N = 64
FP8_NUM_WARPS = 2
FP8_NUM_STAGES = 2
FP8_PROGRAMS_PER_SM = 8
# Programs an SM holds at once at the FP8 tiles (about 6: on an H100 at batch 32 x 4,096,
# 256 pairs, 768 programs ran as one wave and 1,024 did not). With it, the FP8 split count
# fills whole waves (kernels/waves.py) instead of following FP8_PROGRAMS_PER_SM: batch 32 x
# 4,096 0.108 -> 0.100 ms a layer on that H100, 0.093 -> 0.087 on an H200, batches 64 and
# 128 even (bench/RESULTS.md, "FP8 KV decode splits by waves"). 0: the programs-per-SM
# rule, as for bf16 KV.
FP8_RESIDENT_PER_SM = 6
MIN_SPLIT_TOKENS = 256  # below this a split's fixed cost outweighs the parallelism it adds
# ... except when there are very few (request, KV head) pairs: at batch 1 (8 KV heads) the
# whole step has 8 pairs, and 256-token splits leave a 512-token context on 16 SMs. Splits
# of 64 tokens spread it over 64: on an H200, Llama-3-8B shape, batch 1, the step's 32
# attention layers took 0.21 ms instead of 0.36 (decode step 4.72 ms instead of 4.85); at
# batch 8 (64 pairs) 256 stayed faster (bench/probes/attn_split_probe.py, 2026-12-01).
FEW_PAIRS = 16
FEW_PAIRS_MIN_SPLIT_TOKENS = 64
# ... and with few pairs, at most this many splits (0: no cap), so that their merge fuses
# (FUSED_MAX_SPLITS) even when a graph's grid is sized for a long capacity. On an H200 at
# batch 1 (Llama-3-8B shape) the step went from 4.526 to 4.484 ms at context 512 and
# stayed within 0.03 ms at 2048 and 4096 (bench/probes/fusion_probe.py, 2026-12-01).
FEW_PAIRS_MAX_SPLITS = 32
# Split until (B * Hkv * splits) reaches this many programs per SM: many short programs
# keep the last wave's tail small (about 2 run at once per SM at the default tiles).
PROGRAMS_PER_SM = 16
# Grids of at most FUSED_MAX_SPLITS splits merge in the last split program of each
# (request, KV head), MERGE_CHUNK splits per pass, instead of a second kernel. With more,
# that one program's serial passes cost more than a merge kernel spread over every query
# head: on an H200, Llama-3-8B shape, the fused merge took batch 32 / context 512 from
# 5.80 to 5.54 ms a step, but batch 1 / 4096 (64 splits) from 4.83 to 4.99 ms
# (bench/probes/fusion_probe.py, 2026-12-01).
FUSED_MAX_SPLITS = 32
MERGE_CHUNK = 16


@triton.jit
def _decode_kernel(
    q_ptr, kv_ptr, bt_ptr, lens_ptr, out_ptr, part_o_ptr, part_lse_ptr, cnt_ptr,
    s_qb, s_qh,  # q strides [B, Hq, D]; D is contiguous
    s_cb, s_ckv, s_cs, s_ch,  # kv_layer strides [NB, 2, BS, Hkv, D]; D is contiguous
    s_btb,  # block_tables row stride
    s_ob, s_oh,  # out strides [B, Hq, D]; D is contiguous
    qk_scale,  # softmax scale * log2(e) (* a float8 cache's K scale): log2-domain scores
    v_scale,  # a float8 cache's V scale (1.0 otherwise): multiplies the output
    split_len,  # tokens per split, a multiple of BLOCK_N (DYN: the least tokens per split)
    num_splits,
    G: tl.constexpr, BLOCK_G: tl.constexpr, D: tl.constexpr, BS: tl.constexpr,
    BLOCK_N: tl.constexpr, SPLIT: tl.constexpr, COMPUTE: tl.constexpr, IEEE: tl.constexpr,
    DYN: tl.constexpr, FUSED: tl.constexpr, G_PAD: tl.constexpr, MERGE_S: tl.constexpr,
    ROUND: tl.constexpr, CLAMP_Q: tl.constexpr, PDL: tl.constexpr,
):
    if PDL:  # q is the kernel before's output; out may reuse its memory (kernels/pdl.py)
        follow()
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    # ROUND, not BLOCK_N: the merge must size the splits the same way. split_len becomes
    # the request's own (DYN): the fused merge counts the splits that hold tokens by it
    seq_len, split_len, start, end = split_range(lens_ptr, b, split, split_len, num_splits,
                                                 ROUND, DYN)
    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, D)
    hq = kvh * G + g  # [BLOCK_G]: q heads sharing this KV head (SDPA's enable_gqa order)
    gmask = g < G
    if SPLIT:
        if start >= seq_len:  # the merge reads only the splits this request used
            if FUSED and split == 0:  # no context (a graph's padding row): zeros, as unsplit
                tl.store(out_ptr + b * s_ob + hq[:, None] * s_oh + d[None, :],
                         tl.zeros([BLOCK_G, D], out_ptr.dtype.element_ty), mask=gmask[:, None])
            return

    q = tl.load(q_ptr + b * s_qb + hq[:, None] * s_qh + d[None, :], mask=gmask[:, None],
                other=0.0)  # [BLOCK_G, D]
    if CLAMP_Q:  # bf16 into fp16 products: a component past fp16's range would be inf
        q = tl.minimum(tl.maximum(q.to(tl.float32), -65504.0), 65504.0)
    q = q.to(COMPUTE)

    m = tl.full([BLOCK_G], float("-inf"), tl.float32)
    lsum = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, D], tl.float32)
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
        if IEEE:
            s = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))
        s = tl.where(nmask[None, :], s, float("-inf"))  # [BLOCK_G, BLOCK_N], unscaled
        m_new = tl.maximum(m, tl.max(s, axis=1) * qk_scale)  # finite: a valid token per tile
        alpha = tl.exp2(m - m_new)
        p = tl.exp2(s * qk_scale - m_new[:, None])  # one FMA per score
        lsum = lsum * alpha + tl.sum(p, axis=1)
        if IEEE:
            acc = acc * alpha[:, None] + tl.dot(p.to(COMPUTE), v, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(COMPUTE), v)
        m = m_new

    o = acc / tl.where(lsum > 0.0, lsum, 1.0)[:, None] * v_scale  # x 1.0 is exact
    if SPLIT:
        part = (b * tl.num_programs(1) * G + hq).to(tl.int64) * num_splits + split  # [BLOCK_G]
        tl.store(part_o_ptr + part[:, None] * D + d[None, :], o, mask=gmask[:, None])
        lse = tl.where(lsum > 0.0, m + tl.log2(tl.maximum(lsum, 1e-30)), float("-inf"))
        tl.store(part_lse_ptr + part, lse, mask=gmask)
        if FUSED:
            # the last of this (request, KV head)'s splits to finish merges them all
            merge_if_last(part_o_ptr, part_lse_ptr, out_ptr, cnt_ptr, b, kvh, seq_len,
                          split_len, s_ob, s_oh, num_splits, G, D, G_PAD, MERGE_S)
    else:
        tl.store(out_ptr + b * s_ob + hq[:, None] * s_oh + d[None, :],
                 o.to(out_ptr.dtype.element_ty), mask=gmask[:, None])


# The fused merge's counters, one per (request, KV head), per device: zero between launches
# (the merging program zeroes its own). One buffer serves every launch on the device, which
# is safe because decode attention launches on one stream in order; the merge kernel
# remains for launches with more pairs than this.
MAX_FUSED_PAIRS = 1 << 16
_counters: dict[torch.device, torch.Tensor] = {}


def _merge_counters(device: torch.device) -> torch.Tensor | None:
    cnt = _counters.get(device)
    if cnt is None:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return None  # not allocated inside a graph's pool; eager warm-up allocates it
        cnt = _counters[device] = torch.zeros(MAX_FUSED_PAIRS, dtype=torch.int32,
                                              device=device)
    return cnt


@functools.cache
def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 4  # the interpreter: small, so CPU tests still exercise several splits
    return torch.cuda.get_device_properties(device).multi_processor_count


def choose_num_splits(batch: int, num_kv_heads: int, max_seq_len: int,
                      device: torch.device, programs_per_sm: int = PROGRAMS_PER_SM) -> int:
    """Enough splits to give every SM programs_per_sm programs, none under min_split_tokens."""
    want = triton.cdiv(programs_per_sm * _num_sms(device), max(1, batch * num_kv_heads))
    return max(1, min(want, most_splits(batch, num_kv_heads, max_seq_len)))


def fp8_num_splits(batch: int, num_kv_heads: int, max_seq_len: int,
                   device: torch.device) -> int:
    """A float8 cache's split count: whole waves of FP8_RESIDENT_PER_SM programs a SM,
    within most_splits."""
    return wave_splits(max(1, batch * num_kv_heads), FP8_RESIDENT_PER_SM * _num_sms(device),
                       most_splits(batch, num_kv_heads, max_seq_len), max_seq_len)


def most_splits(batch: int, num_kv_heads: int, max_seq_len: int) -> int:
    """The most splits a context takes: none under min_split_tokens, and at most
    FEW_PAIRS_MAX_SPLITS where the pairs are few."""
    most = triton.cdiv(max_seq_len, min_split_tokens(batch, num_kv_heads))
    if FEW_PAIRS_MAX_SPLITS and batch * num_kv_heads <= FEW_PAIRS:
        most = min(most, FEW_PAIRS_MAX_SPLITS)
    return most


def min_split_tokens(batch: int, num_kv_heads: int) -> int:
    """The least tokens a split holds (see FEW_PAIRS)."""
    return FEW_PAIRS_MIN_SPLIT_TOKENS if batch * num_kv_heads <= FEW_PAIRS else MIN_SPLIT_TOKENS


def decode_attention(
    q: torch.Tensor,  # [B, Hq, D]: one query per request
    kv_layer: torch.Tensor,  # [NB, 2, BS, Hkv, D]
    block_tables: torch.Tensor,  # [B, max_blocks] int32
    seq_lens: torch.Tensor,  # [B] int32: context length including this token (>= 1)
    scale: float,
    out: torch.Tensor | None = None,  # [B, Hq, D]
    *,
    max_seq_len: int | None = None,  # host-side bound on seq_lens; sizes the splits
    num_splits: int | None = None,  # override the heuristic (tests, tuning)
    block_n: int | None = None,  # None: the cache dtype's default (BLOCK_N or FP8_BLOCK_N)
    num_warps: int | None = None,
    num_stages: int | None = None,
    programs_per_sm: int | None = None,  # None: PROGRAMS_PER_SM (float8: fp8_num_splits)
    fused_merge: bool | None = None,  # None: when num_splits <= FUSED_MAX_SPLITS
    k_scale: float = 1.0,  # float8 cache: this layer's K and V scales
    v_scale: float = 1.0,
) -> torch.Tensor:
    hq, hkv, bs = check_paged_qkv(q, kv_layer, "[B, Hq, D]")
    bsz, d = q.shape[0], q.shape[2]
    check(block_tables.dim() == 2 and block_tables.shape[0] == bsz, "block_tables: expected [B, *]")
    check_shape("seq_lens", seq_lens, (bsz,))
    check_float("q", q)
    check_kv("kv_layer", kv_layer)
    check_int("block_tables", block_tables)
    check_int("seq_lens", seq_lens)
    check(q.stride(2) == 1 and kv_layer.stride(4) == 1, "q, kv_layer: head_dim must be contiguous")
    check(block_tables.stride(1) == 1, "block_tables: rows must be contiguous")
    if out is None:
        out = torch.empty_like(q)
    check_shape("out", out, q.shape)
    check(out.stride(2) == 1, "out: head_dim must be contiguous")
    check_device(q, kv_layer, block_tables, seq_lens, out)
    if bsz == 0:
        return out
    # the cache dtype's defaults for what the caller left out
    defaults = ((FP8_BLOCK_N, FP8_NUM_WARPS, FP8_NUM_STAGES, FP8_PROGRAMS_PER_SM)
                if is_fp8(kv_layer) else (BLOCK_N, NUM_WARPS, NUM_STAGES, PROGRAMS_PER_SM))
    block_n, num_warps, num_stages = (
        d if v is None else v
        for v, d in zip((block_n, num_warps, num_stages), defaults[:3], strict=True))

    dyn = max_seq_len is None
    if max_seq_len is None:
        max_seq_len = block_tables.shape[1] * bs
    if num_splits is None:
        if is_fp8(kv_layer) and programs_per_sm is None and FP8_RESIDENT_PER_SM:
            num_splits = fp8_num_splits(bsz, hkv, max_seq_len, q.device)
        else:
            num_splits = choose_num_splits(bsz, hkv, max_seq_len, q.device,
                                           programs_per_sm or defaults[3])
    split_len = triton.cdiv(triton.cdiv(max(max_seq_len, 1), num_splits), block_n) * block_n
    num_splits = triton.cdiv(max(max_seq_len, 1), split_len)  # drop splits rounding emptied
    if dyn and num_splits > 1:
        # the least a split holds; each program sizes its split from its request's length
        split_len = triton.cdiv(min(min_split_tokens(bsz, hkv), split_len), block_n) * block_n
    g = hq // hkv
    split = num_splits > 1
    if split:
        # One allocation for both (each costs host time): [B, Hq, S, D] outputs, [B, Hq, S] lse.
        part = torch.empty(bsz * hq * num_splits * (d + 1), dtype=torch.float32,
                           device=q.device)
        part_o = part[: bsz * hq * num_splits * d]
        part_lse = part[bsz * hq * num_splits * d:]
    else:
        part_o = part_lse = out  # unused
    # Allocated at the first launch, split or not, so that an eager warm-up (unsplit at a
    # large batch) has it in place before graphs capture the split sizes.
    cnt = _merge_counters(q.device)
    fused = (split and cnt is not None and bsz * hkv <= MAX_FUSED_PAIRS
             and (num_splits <= FUSED_MAX_SPLITS if fused_merge is None else fused_merge))
    if not fused:
        cnt = None
    block_g = max(16, triton.next_power_of_2(g))
    fp16 = kv_fp16_products(q, kv_layer)
    pdl = pdl_for(q)
    compute = tl.float16 if fp16 else kv_compute_dtype(q, kv_layer)
    merge_s = min(MERGE_CHUNK, max(2, triton.next_power_of_2(num_splits)))
    want = fit_attention_tiles(Tiles(block_g, block_n, num_stages, num_warps), d,
                               kv_layer.dtype, q.device, min_block_m=block_g)

    def launch(t: Tiles) -> None:
        _decode_kernel[(bsz, hkv, num_splits)](
            q, kv_layer, block_tables, seq_lens, out, part_o, part_lse,
            cnt if cnt is not None else seq_lens,  # unused pointer when not fused
            q.stride(0), q.stride(1),
            kv_layer.stride(0), kv_layer.stride(1), kv_layer.stride(2), kv_layer.stride(3),
            block_tables.stride(0), out.stride(0), out.stride(1),
            scale * LOG2E * k_scale, float(v_scale), split_len, num_splits,
            G=g, BLOCK_G=block_g, D=d, BS=bs, BLOCK_N=t.block_n, SPLIT=split,
            COMPUTE=compute, CLAMP_Q=fp16, IEEE=kv_ieee(q, kv_layer), DYN=dyn and split,
            FUSED=fused, G_PAD=triton.next_power_of_2(g), ROUND=block_n, MERGE_S=merge_s,
            PDL=pdl, num_warps=t.num_warps, num_stages=t.num_stages, launch_pdl=pdl,
        )

    # split_len is a multiple of block_n; shrinking halves block_n, so it still divides it.
    launch_fitting(("decode", kv_layer.dtype, d, q.device), want, launch, min_block_m=block_g)
    if split and not fused:
        merge_kernel[(bsz, hq)](
            part_o, part_lse, out, seq_lens, out.stride(0), out.stride(1), split_len,
            num_splits, D=d, BLOCK_S=max(2, triton.next_power_of_2(num_splits)),
            BLOCK_N=block_n, DYN=dyn, PDL=pdl, num_warps=4, launch_pdl=pdl,
        )
    return out

