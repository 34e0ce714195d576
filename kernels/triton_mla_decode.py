"""Triton paged MLA decode in the absorbed form, split-K over the context (flash-decoding).

MLA's cache holds one latent row per token (``[c | k_pe]``, C + R values) that every
query head reads, so decode is multi-query attention over one "head" whose value is the
row's first C values (ref_mla_decode.mla_decode_ref is the contract). One program owns
(request, block of BLOCK_H query heads, split): it streams that split's latent rows once
and scores all its heads against them, so HBM traffic is the latent bytes times the number
of head blocks (one at H <= BLOCK_H). The score is two products, ``q_c . c`` and
``q_r . k_pe``, so neither C nor R has to be padded to the other's power of two.

Long contexts are split along the sequence so the whole GPU streams the cache; a second
kernel merges the splits by their log-sum-exp. Host syncs: none. Without a
``max_seq_len`` hint (CUDA graphs, whose grid is fixed at capture) the split count is
sized for the block table's capacity and each request spreads its own context over those
splits on the device (at least min_split_tokens each), as triton_decode_attention does.
A request of length 0 (a graph's padding row) gets zeros. A float8 latent cache is upcast
on load to the query's dtype; its scale folds into the softmax scale and multiplies the
output (the latent is both key and value).

Tiles and the split count are tuned on an H200 at DeepSeek-V2-Lite's shape (16 heads,
latent 512 + 64, bf16; ``bench/moe_bench.py --shape v2lite --tune-mla``,
bench/results/mla_tune_h200.json).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch
import triton
import triton.language as tl

from kernels import triton_mla_decode_tma as tma_mod
from kernels.pdl import follow, pdl_for
from kernels.triton_common import (
    check,
    check_device,
    check_float,
    check_int,
    check_kv,
    check_shape,
    kv_compute_dtype,
    kv_ieee,
)
from kernels.triton_split_len import head_block_split, request_splits_holding
from kernels.waves import wave_splits

LOG2E = 1.4426950408889634

BLOCK_N = 32  # latent rows per inner-loop tile (a [32, 512] bf16 tile is 32 KiB)
NUM_STAGES = 2
# Warps per program by heads per program. A 16-head block at 4 warps is the fastest measured
# on an H200: batch 32 x 4096 tokens 1.69 ms for 27 layers against 2.99 ms at 8 warps (with
# the split count below); 32 heads keep 8 warps. Neither spills compiled as launched
# (tests/kernels/test_mla_sm90.py; the 120 bytes once reported at 4 warps came from a
# compile without the launch's 16-divisible pointers and strides).
NUM_WARPS = {16: 4, 32: 8}
MIN_SPLIT_TOKENS = 256  # below this a split's fixed cost outweighs the parallelism it adds
# ... except when the whole call is a few programs' worth of (request, head block) pairs: at
# batch 1 (one latent "head", one 16-head block) 256-token splits leave a 512-token context
# to two programs, each walking eight tiles in a row while the rest of the GPU idles. This
# is decode attention's few-pairs rule (kernels/triton_decode_attention.FEW_PAIRS), for MLA.
FEW_PROGRAMS = 8  # batch x head blocks at or under this count as few
FEW_PROGRAMS_MIN_SPLIT_TOKENS = 64
# Programs an SM holds at once (BLOCK_N 32, 4 warps: two, by registers). The split count
# fills whole waves of them (kernels/waves.py): a grid a little past one wave runs a second
# wave of stragglers as long as the first. H100, V2-Lite's 27 layers at 4,096 tokens: batch
# 128 at 3 splits (384 programs for 264 places) 7.51 ms, at 2 splits 6.05 (70% -> 87% of
# HBM read); batch 32 at 9 splits (288) 2.20 ms, at 8 1.84 (bench/RESULTS.md, "MLA decode
# splits that fill one wave").
PROGRAMS_PER_SM = 2
# Which form of the kernel runs, read at call time: "pointer" (this module's) or "tma" (each
# page's tile by the copy engine, kernels/triton_mla_decode_tma.py, where the shapes allow;
# else this one). The pointer form until an H200 A/B says otherwise. (A third, tokens as the
# products' rows so that they were warpgroup MMAs at one program an SM, took 1.3-1.4x the
# pointer form's time on an H100 and was taken out: bench/RESULTS.md, "The transposed forms
# on a GPU"; the tree of 3aa6029 has it.)
FORM = "pointer"
FORMS = ("pointer", "tma")
MAX_SPLITS = 64  # each split's partial output is [B, H, C] float32 of scratch
MERGE_CHUNK = 8  # splits the merge holds in registers at once ([8, 512] float32)


@triton.jit
def _mla_decode_kernel(
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
    COMPUTE: tl.constexpr, IEEE: tl.constexpr, DYN: tl.constexpr, PDL: tl.constexpr,
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
    q_row = q_ptr + b.to(tl.int64) * s_qb + h[:, None] * s_qh
    q_c = tl.load(q_row + c[None, :], mask=hmask[:, None] & cmask[None, :],
                  other=0.0).to(COMPUTE)  # [BLOCK_H, CP]
    q_r = tl.load(q_row + C + r[None, :], mask=hmask[:, None] & rmask[None, :],
                  other=0.0).to(COMPUTE)  # [BLOCK_H, RP]

    m = tl.full([BLOCK_H], float("-inf"), tl.float32)
    lsum = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, CP], tl.float32)
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
        if IEEE:
            s = tl.dot(q_c, tl.trans(lat), input_precision="ieee")
            s += tl.dot(q_r, tl.trans(kpe), input_precision="ieee")
        else:
            s = tl.dot(q_c, tl.trans(lat))
            s += tl.dot(q_r, tl.trans(kpe))
        s = tl.where(nmask[None, :], s, float("-inf"))  # [BLOCK_H, BLOCK_N], unscaled
        m_new = tl.maximum(m, tl.max(s, axis=1) * qk_scale)  # finite: a valid token per tile
        alpha = tl.exp2(m - m_new)
        p = tl.exp2(s * qk_scale - m_new[:, None])
        lsum = lsum * alpha + tl.sum(p, axis=1)
        if IEEE:
            acc = acc * alpha[:, None] + tl.dot(p.to(COMPUTE), lat, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(COMPUTE), lat)
        m = m_new

    o = acc / tl.where(lsum > 0.0, lsum, 1.0)[:, None] * v_scale  # no context: zeros
    if SPLIT:
        part = (b * H + h).to(tl.int64) * num_splits + split  # [BLOCK_H]
        tl.store(part_o_ptr + part[:, None] * CP + c[None, :], o, mask=hmask[:, None])
        lse = tl.where(lsum > 0.0, m + tl.log2(tl.maximum(lsum, 1e-30)), float("-inf"))
        tl.store(part_lse_ptr + part, lse, mask=hmask)
    else:
        tl.store(out_ptr + b * s_ob + h[:, None] * s_oh + c[None, :],
                 o.to(out_ptr.dtype.element_ty), mask=hmask[:, None] & cmask[None, :])


@triton.jit
def _merge_row(part_o_ptr, part_lse_ptr, lens_ptr, b, h, H, split_len, num_splits,
               CP: tl.constexpr, MERGE_S: tl.constexpr, BLOCK_N: tl.constexpr,
               DYN: tl.constexpr):
    """One (request, head)'s splits merged, MERGE_S at a time with an online log-sum-exp
    (a [splits, C] tile at once spills registers past a few splits, ptxas sm_90): its
    [CP] float32 output, unrounded. The merge kernel stores it; the W_UV product of
    kernels/triton_mla_up_merge.py multiplies it without a store between."""
    used = request_splits_holding(lens_ptr, b, split_len, num_splits, BLOCK_N, DYN)
    sp = tl.arange(0, MERGE_S)
    c = tl.arange(0, CP)
    base = (b * H + h).to(tl.int64) * num_splits
    mx = tl.full([1], float("-inf"), tl.float32)
    wsum = tl.zeros([1], tl.float32)
    acc = tl.zeros([CP], tl.float32)
    for s0 in range(0, used, MERGE_S):
        smask = s0 + sp < used
        lse = tl.load(part_lse_ptr + base + s0 + sp, mask=smask, other=float("-inf"))
        o = tl.load(part_o_ptr + (base + s0 + sp)[:, None] * CP + c[None, :],
                    mask=smask[:, None], other=0.0)  # [MERGE_S, CP]
        mx_new = tl.maximum(mx, tl.max(lse, axis=0))  # finite: s0 < used
        scale = tl.exp2(mx - mx_new)
        w = tl.exp2(lse - mx_new)  # [MERGE_S]; unused splits weigh 0
        wsum = wsum * scale + tl.sum(w, axis=0)
        acc = acc * scale + tl.sum(o * w[:, None], axis=0)
        mx = mx_new
    return acc / tl.where(wsum > 0.0, wsum, 1.0)  # no context (used 0): zeros


@triton.jit
def _mla_merge_kernel(
    part_o_ptr, part_lse_ptr, out_ptr, lens_ptr,
    s_ob, s_oh,
    split_len,  # as the decode kernel's (DYN: the least tokens per split)
    num_splits,
    C: tl.constexpr, CP: tl.constexpr, MERGE_S: tl.constexpr, BLOCK_N: tl.constexpr,
    DYN: tl.constexpr, PDL: tl.constexpr,
):
    """Merges one (request, head)'s splits (_merge_row) into out."""
    if PDL:  # the partials are the decode kernel's output (kernels/pdl.py)
        follow()
    b = tl.program_id(0)
    h = tl.program_id(1)
    res = _merge_row(part_o_ptr, part_lse_ptr, lens_ptr, b, h, tl.num_programs(1), split_len,
                     num_splits, CP, MERGE_S, BLOCK_N, DYN)
    c = tl.arange(0, CP)
    tl.store(out_ptr + b * s_ob + h * s_oh + c, res.to(out_ptr.dtype.element_ty), mask=c < C)


@functools.cache
def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        # the interpreter: small, so CPU tests still exercise several splits (up to batch
        # 31: one wave of 32 programs)
        return 16
    return torch.cuda.get_device_properties(device).multi_processor_count


def min_split_tokens(batch: int, head_blocks: int) -> int:
    """The least tokens a split holds (see FEW_PROGRAMS)."""
    if batch * head_blocks <= FEW_PROGRAMS:
        return FEW_PROGRAMS_MIN_SPLIT_TOKENS
    return MIN_SPLIT_TOKENS


def choose_num_splits(batch: int, head_blocks: int, max_seq_len: int,
                      device: torch.device, programs_per_sm: int | None = None) -> int:
    """The split count whose grid best fills whole waves of programs_per_sm (default
    PROGRAMS_PER_SM) programs a SM (kernels/waves.py), none under min_split_tokens, at most
    MAX_SPLITS."""
    least = min_split_tokens(batch, head_blocks)
    most = min(MAX_SPLITS, triton.cdiv(max_seq_len, least))
    per_sm = PROGRAMS_PER_SM if programs_per_sm is None else programs_per_sm
    return wave_splits(max(1, batch * head_blocks), per_sm * _num_sms(device), most,
                       max_seq_len)


@dataclass(frozen=True)
class UnmergedDecode:
    """What the decode kernel left: ``out`` holds the result when the context was not split;
    otherwise the splits' partials wait for a merge (``mla_decode``'s merge kernel, or the
    W_UV product that merges as it loads: kernels/triton_mla_up_merge.py)."""

    out: torch.Tensor  # [B, H, C]
    part_o: torch.Tensor | None  # [B, H, S, CP] float32 partial outputs (None: not split)
    part_lse: torch.Tensor  # [B, H, S] float32, their log2-sum-exp (out when not split)
    split_len: int  # as the kernel's (DYN: the least tokens per split)
    num_splits: int
    block_n: int
    dyn: bool  # each request sizes its splits from its own length
    cp: int  # C padded to a power of two: the partials' row width

    @property
    def merge_s(self) -> int:
        """Splits a merge holds in registers at once."""
        return min(MERGE_CHUNK, triton.next_power_of_2(self.num_splits))


def mla_decode_unmerged(
    q: torch.Tensor,  # [B, H, C + R]: [q_nope @ W_UK | roped q_pe] per head
    kv_layer: torch.Tensor,  # [NB, 1, BS, 1, C + R]
    block_tables: torch.Tensor,  # [B, max_blocks] int32
    seq_lens: torch.Tensor,  # [B] int32: context length including this token (0: none)
    scale: float,
    kv_lora_rank: int,  # C
    out: torch.Tensor | None = None,  # [B, H, C]
    *,
    max_seq_len: int | None = None,  # host-side bound on seq_lens; sizes the splits
    num_splits: int | None = None,  # override the heuristic (tests, tuning)
    # tiles; None: the form's own defaults, read at call time (this module's BLOCK_N,
    # NUM_WARPS, NUM_STAGES for the pointer form). A given block_n is the pointer form's:
    # the TMA form, whose tile is the page's, then gives way to pointers.
    block_n: int | None = None,
    block_h: int | None = None,  # query heads per program (None: 16, or 32 past 16 heads)
    num_warps: int | None = None,
    num_stages: int | None = None,
    kv_scale: float = 1.0,  # float8 cache: this layer's latent scale
    form: str | None = None,  # one of FORMS (None: FORM)
) -> UnmergedDecode:
    """The decode kernel alone: the result in ``out`` when one split holds the context, else
    the splits' partials for a merge (``mla_decode`` takes both steps)."""
    check(q.dim() == 3, "q: expected [B, H, C + R]")
    bsz, heads, width = q.shape
    c = kv_lora_rank
    check(0 < c < width, f"kv_lora_rank: {c} outside (0, {width})")
    check(kv_layer.dim() == 5 and kv_layer.shape[1] == 1 and kv_layer.shape[3] == 1
          and kv_layer.shape[4] == width, f"kv_layer: expected [NB, 1, BS, 1, {width}]")
    check(block_tables.dim() == 2 and block_tables.shape[0] == bsz,
          "block_tables: expected [B, *]")
    check_shape("seq_lens", seq_lens, (bsz,))
    check_float("q", q)
    check_kv("kv_layer", kv_layer)
    check_int("block_tables", block_tables)
    check_int("seq_lens", seq_lens)
    check(q.stride(2) == 1 and kv_layer.stride(4) == 1, "q, kv_layer: last dim must be "
          "contiguous")
    check(block_tables.stride(1) == 1, "block_tables: rows must be contiguous")
    if out is None:
        out = q.new_empty(bsz, heads, c)
    check_shape("out", out, (bsz, heads, c))
    check(out.stride(2) == 1, "out: last dim must be contiguous")
    check_device(q, kv_layer, block_tables, seq_lens, out)
    bs = kv_layer.shape[2]
    form = FORM if form is None else form
    check(form in FORMS, f"form: {form!r} is not one of {FORMS}")
    if form == "tma" and (block_n is not None or not tma_mod.tma_fits(q, kv_layer, c)):
        form = "pointer"  # its tile is the page's (a given block_n is the pointer form's)
    # the form's tile and residency (programs an SM; None: PROGRAMS_PER_SM)
    tile, per_sm = BLOCK_N, None
    if form == "tma":
        tile, per_sm = tma_mod.tile_rows(bs), tma_mod.PROGRAMS_PER_SM
    if block_n is None:
        block_n = tile
    if bsz == 0:
        return UnmergedDecode(out, None, out, 0, 1, block_n, False, c)
    if block_h is None:
        block_h = 16 if heads <= 16 else 32
    head_blocks = triton.cdiv(heads, block_h)
    if num_warps is None and form == "pointer":  # the other forms' own defaults otherwise
        num_warps = NUM_WARPS.get(block_h, 8)
    dyn = max_seq_len is None
    if max_seq_len is None:
        max_seq_len = block_tables.shape[1] * bs
    if num_splits is None:
        num_splits = choose_num_splits(bsz, head_blocks, max_seq_len, q.device, per_sm)
    split_len = triton.cdiv(triton.cdiv(max(max_seq_len, 1), num_splits), block_n) * block_n
    num_splits = triton.cdiv(max(max_seq_len, 1), split_len)  # drop splits rounding emptied
    if dyn and num_splits > 1:
        # the least a split holds; each program sizes its split from its request's length
        least = min_split_tokens(bsz, head_blocks)
        split_len = triton.cdiv(min(least, split_len), block_n) * block_n
    split = num_splits > 1
    cp = max(16, triton.next_power_of_2(c))
    rp = max(16, triton.next_power_of_2(width - c))
    if split:
        # One allocation for both: [B, H, S, CP] partial outputs, [B, H, S] their lse.
        part = torch.empty(bsz * heads * num_splits * (cp + 1), dtype=torch.float32,
                           device=q.device)
        part_o = part[: bsz * heads * num_splits * cp]
        part_lse = part[bsz * heads * num_splits * cp:]
    else:
        part_o = part_lse = out  # unused
    pdl = pdl_for(q)
    done = UnmergedDecode(out, part_o if split else None, part_lse, split_len, num_splits,
                          block_n, dyn and split, cp)
    if form == "tma":
        tma_mod.launch(q, kv_layer, block_tables, seq_lens, out, part_o, part_lse,
                       scale * LOG2E * kv_scale, float(kv_scale), split_len, num_splits, c,
                       cp, block_h, block_n, split, dyn and split,
                       kv_compute_dtype(q, kv_layer), kv_ieee(q, kv_layer), pdl, num_warps,
                       num_stages)
        return done
    _mla_decode_kernel[(bsz, head_blocks, num_splits)](
        q, kv_layer, block_tables, seq_lens, out, part_o, part_lse,
        q.stride(0), q.stride(1), kv_layer.stride(0), kv_layer.stride(2),
        block_tables.stride(0), out.stride(0), out.stride(1),
        scale * LOG2E * kv_scale, float(kv_scale), split_len, num_splits, heads,
        C=c, R=width - c, CP=cp, RP=rp, BLOCK_H=block_h, BS=bs, BLOCK_N=block_n,
        SPLIT=split, COMPUTE=kv_compute_dtype(q, kv_layer), IEEE=kv_ieee(q, kv_layer),
        DYN=dyn and split, PDL=pdl, num_warps=num_warps,
        num_stages=NUM_STAGES if num_stages is None else num_stages, launch_pdl=pdl,
    )
    return done


def mla_decode(
    q: torch.Tensor,  # [B, H, C + R]: [q_nope @ W_UK | roped q_pe] per head
    kv_layer: torch.Tensor,  # [NB, 1, BS, 1, C + R]
    block_tables: torch.Tensor,  # [B, max_blocks] int32
    seq_lens: torch.Tensor,  # [B] int32: context length including this token (0: none)
    scale: float,
    kv_lora_rank: int,  # C
    out: torch.Tensor | None = None,  # [B, H, C]
    **options: Any,  # mla_decode_unmerged's options (max_seq_len, tiles, kv_scale, form)
) -> torch.Tensor:
    """Paged MLA decode: the decode kernel, then the merge of its splits where it split."""
    d = mla_decode_unmerged(q, kv_layer, block_tables, seq_lens, scale, kv_lora_rank, out,
                            **options)
    if d.part_o is not None:
        pdl = pdl_for(q)
        _mla_merge_kernel[(d.out.shape[0], d.out.shape[1])](
            d.part_o, d.part_lse, d.out, seq_lens, d.out.stride(0), d.out.stride(1),
            d.split_len, d.num_splits, C=kv_lora_rank, CP=d.cp, MERGE_S=d.merge_s,
            BLOCK_N=d.block_n, DYN=d.dyn, PDL=pdl, num_warps=4, launch_pdl=pdl,
        )
    return d.out
