"""Triton prefill attention for MLA on the decompressed context: causal, ragged, no padding.

MLA's prefill (engine/models/mla.py) attends on keys and values decompressed from the
latent cache: per head a key ``[k_nope | k_pe]`` (Dn + R values, k_pe shared by every head)
and a value of Dv values. DeepSeek's dims are Dn 128, R 64, Dv 128. The GQA prefill kernel
wants one power-of-two head dim for q, K and V, so MLA used to pad all three to 256 and
copy the context into a zero-filled paged layout: a third more work in q.k, twice in p.V,
a [BLOCK_M, 256] float32 accumulator that spilled, and the copies. On one H200 V2-Lite's
4,096-token prefill spent 41.9 of its 104 kernel ms there (bench/RESULTS.md).

This kernel reads the parts where they are: q_nope and q_pe as the projection left them,
k_nope and v as kv_b_proj wrote them (one row of H x (Dn + Dv) per context token), and k_pe
from the latent rows (one row of R per token, read once per key tile whatever the head).
q.k is two dot products into one score tile; the accumulator is [BLOCK_M, Dv].

A request's decompressed context is one contiguous run of rows, from ``starts[b]``: the
caller decompresses whole block-table rows in order, so no block table is read here.
Query ``j`` of request ``b``'s chunk (``n_q`` queries, ``cu`` offsets) sits at position
``lens[b] - n_q + j`` and sees keys ``0 ..`` that position.

Grid: (head, query-tile slot), the slots laid out as the GQA prefill kernel's
(kernels/triton_query_tiles.py), run last-first so the longest causal tiles start first.
There is no split over keys: a prefill step has ``T / BLOCK_M`` tiles per head, enough
programs for the chunk sizes a step runs (a short chunk after a long cached context runs
on few programs; it is correct, not fast).

Host syncs: none (the grid comes from shapes).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.tile_fit import Tiles, launch_fitting
from kernels.triton_common import (
    check,
    check_device,
    check_float,
    check_int,
    check_shape,
    compute_dtype,
)
from kernels.triton_query_tiles import request_of_slot

LOG2E = 1.4426950408889634

# bf16 / fp16 tiles (H200, bench/mla_prefill_bench.py: 3 stages over 2 took V2-Lite's
# 4,096-token layer from 0.281 to 0.268 ms and V3's 128 heads from 2.23 to 1.67 ms).
# float32 runs its products in IEEE precision on CUDA cores, whose operands live in
# registers: at DeepSeek's dims only 16 x 16 tiles compile for sm_90 without spilling
# (tests/kernels/test_mla_sm90.py), and float32 serves correctness tests, not speed.
# launch_fitting shrinks either on OutOfResources.
BLOCK_M = 128
BLOCK_N = 64
NUM_WARPS = 8
NUM_STAGES = 3
FP32_TILES = Tiles(block_m=16, block_n=16, num_stages=2, num_warps=4)


@triton.jit
def _attend(acc, m, lsum, qn, qp, kv_h, kpe_ptr, s_kvt, s_kpt, qk_scale, qpos, base, lo, hi,
            DN: tl.constexpr, DR: tl.constexpr, DV: tl.constexpr,
            DN_P: tl.constexpr, DR_P: tl.constexpr, DV_P: tl.constexpr,
            BLOCK_N: tl.constexpr, MASKED: tl.constexpr, COMPUTE: tl.constexpr,
            IEEE: tl.constexpr):
    """Online softmax over keys [lo, hi) (the diagonal's tiles with MASKED)."""
    dn = tl.arange(0, DN_P)
    dr = tl.arange(0, DR_P)
    dv = tl.arange(0, DV_P)
    for n0 in range(lo, hi, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)  # [BLOCK_N] key positions
        row = (base + n).to(tl.int64)
        if MASKED:
            nm = n < hi
            kn = tl.load(kv_h + row[None, :] * s_kvt + dn[:, None],
                         mask=nm[None, :] & (dn < DN)[:, None], other=0.0)  # [DN_P, BLOCK_N]
            kp = tl.load(kpe_ptr + row[None, :] * s_kpt + dr[:, None],
                         mask=nm[None, :] & (dr < DR)[:, None], other=0.0)  # [DR_P, BLOCK_N]
            v = tl.load(kv_h + DN + row[:, None] * s_kvt + dv[None, :],
                        mask=nm[:, None] & (dv < DV)[None, :], other=0.0)  # [BLOCK_N, DV_P]
        else:
            kn = tl.load(kv_h + row[None, :] * s_kvt + dn[:, None],
                         mask=(dn < DN)[:, None], other=0.0)
            kp = tl.load(kpe_ptr + row[None, :] * s_kpt + dr[:, None],
                         mask=(dr < DR)[:, None], other=0.0)
            v = tl.load(kv_h + DN + row[:, None] * s_kvt + dv[None, :],
                        mask=(dv < DV)[None, :], other=0.0)
        kn = kn.to(COMPUTE)
        kp = kp.to(COMPUTE)
        v = v.to(COMPUTE)
        if IEEE:
            s = tl.dot(qn, kn, input_precision="ieee")
            s = tl.dot(qp, kp, acc=s, input_precision="ieee")  # [BLOCK_M, BLOCK_N]
        else:
            s = tl.dot(qn, kn)
            s = tl.dot(qp, kp, acc=s)
        if MASKED:
            s = tl.where((n[None, :] <= qpos[:, None]) & nm[None, :], s, float("-inf"))
        # Finite: each row's first tile holds key 0, which every row sees.
        m_new = tl.maximum(m, tl.max(s, axis=1) * qk_scale)  # log2 domain
        alpha = tl.exp2(m - m_new)
        p = tl.exp2(s * qk_scale - m_new[:, None])
        lsum = lsum * alpha + tl.sum(p, axis=1)
        if IEEE:
            acc = acc * alpha[:, None] + tl.dot(p.to(COMPUTE), v, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(COMPUTE), v)
        m = m_new
    return acc, m, lsum


# The request count changes every step: specialized, each value class would be another
# compile in the middle of serving (see kernels/triton_prefill_attention.py).
@triton.jit(do_not_specialize=["num_reqs", "search_steps"])
def _mla_prefill_kernel(
    qn_ptr, qp_ptr, kv_ptr, kpe_ptr, starts_ptr, cu_ptr, lens_ptr, out_ptr,
    s_qnt, s_qnh, s_qpt, s_qph,  # q_nope [T, H, Dn], q_pe [T, H, R]
    s_kvt, s_kvh,  # kv [N, H, Dn + Dv]: k_nope then v
    s_kpt,  # k_pe [N, R]
    s_ot, s_oh,  # out [T, H, Dv]
    qk_scale,  # softmax scale * log2(e)
    num_reqs, search_steps,  # B, and ceil(log2(B + 1)) binary-search steps
    DN: tl.constexpr, DR: tl.constexpr, DV: tl.constexpr,
    DN_P: tl.constexpr, DR_P: tl.constexpr, DV_P: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, COMPUTE: tl.constexpr, IEEE: tl.constexpr,
):
    h = tl.program_id(0)  # fastest: a tile's heads run together and share k_pe in L2
    slot = tl.num_programs(1) - 1 - tl.program_id(1)  # last requests' last tiles first
    # the request owning this slot, and the slot's query tile within its chunk
    b, q_start, n_q, mt = request_of_slot(cu_ptr, slot, num_reqs, search_steps, BLOCK_M)
    if mt * BLOCK_M >= n_q:
        return
    seq_len = tl.load(lens_ptr + b)
    ctx = seq_len - n_q  # cached tokens before this chunk
    base = tl.load(starts_ptr + b)  # the request's key 0 in kv / k_pe

    mi = mt * BLOCK_M + tl.arange(0, BLOCK_M)  # query index within the chunk
    mmask = mi < n_q
    tok = (q_start + mi).to(tl.int64)
    dn = tl.arange(0, DN_P)
    dr = tl.arange(0, DR_P)
    dv = tl.arange(0, DV_P)
    qn = tl.load(qn_ptr + tok[:, None] * s_qnt + h * s_qnh + dn[None, :],
                 mask=mmask[:, None] & (dn < DN)[None, :], other=0.0).to(COMPUTE)
    qp = tl.load(qp_ptr + tok[:, None] * s_qpt + h * s_qph + dr[None, :],
                 mask=mmask[:, None] & (dr < DR)[None, :], other=0.0).to(COMPUTE)
    qpos = ctx + mi

    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    lsum = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, DV_P], tl.float32)
    kv_h = kv_ptr + h * s_kvh
    # keys below the tile's first query position are visible to all its queries
    diag = (ctx + mt * BLOCK_M) // BLOCK_N * BLOCK_N
    end = tl.minimum(seq_len, ctx + (mt + 1) * BLOCK_M)
    acc, m, lsum = _attend(acc, m, lsum, qn, qp, kv_h, kpe_ptr, s_kvt, s_kpt, qk_scale, qpos,
                           base, 0, diag, DN, DR, DV, DN_P, DR_P, DV_P, BLOCK_N, False,
                           COMPUTE, IEEE)
    acc, m, lsum = _attend(acc, m, lsum, qn, qp, kv_h, kpe_ptr, s_kvt, s_kpt, qk_scale, qpos,
                           base, diag, end, DN, DR, DV, DN_P, DR_P, DV_P, BLOCK_N, True,
                           COMPUTE, IEEE)
    o = acc / lsum[:, None]
    tl.store(out_ptr + tok[:, None] * s_ot + h * s_oh + dv[None, :],
             o.to(out_ptr.dtype.element_ty), mask=mmask[:, None] & (dv < DV)[None, :])


def _pow2(n: int) -> int:
    return max(16, triton.next_power_of_2(n))


def mla_prefill(
    q_nope: torch.Tensor,  # [T, H, Dn]: the step's prefilling queries, packed
    q_pe: torch.Tensor,  # [T, H, R]: their roped parts
    kv: torch.Tensor,  # [N, H, Dn + Dv]: each context token's k_nope, then v (kv_b_proj)
    k_pe: torch.Tensor,  # [N, R]: each context token's roped key (every head's)
    starts: torch.Tensor,  # [B] int: request b's key 0 is row starts[b] of kv and k_pe
    cu_seqlens_q: torch.Tensor,  # [B + 1] int32: request b's queries are rows cu[b]:cu[b+1]
    seq_lens: torch.Tensor,  # [B] int32: context length after this chunk (cached + chunk)
    scale: float,
    out: torch.Tensor | None = None,  # [T, H, Dv]
    *,
    tiles: Tiles | None = None,  # None: the dtype's defaults above
) -> torch.Tensor:
    """Causal attention of each request's chunk on its whole context (module docstring);
    kernels/ref_mla_prefill.mla_prefill_ref is the contract."""
    check(q_nope.dim() == 3 and q_pe.dim() == 3, "q_nope, q_pe: expected [T, H, D]")
    t, h, dn = q_nope.shape
    r = q_pe.shape[2]
    check_shape("q_pe", q_pe, (t, h, r))
    if not (kv.dim() == 3 and kv.shape[1] == h and kv.shape[2] > dn):
        raise ValueError(f"kv: expected [N, {h}, {dn} + Dv], got {list(kv.shape)}")
    dv = kv.shape[2] - dn
    check_shape("k_pe", k_pe, (kv.shape[0], r))
    bsz = starts.shape[0]
    check_shape("cu_seqlens_q", cu_seqlens_q, (bsz + 1,))
    check_shape("seq_lens", seq_lens, (bsz,))
    for name, x in (("q_nope", q_nope), ("q_pe", q_pe), ("kv", kv), ("k_pe", k_pe)):
        check_float(name, x)
        if x.stride(-1) != 1:
            raise ValueError(f"{name}: the last dim must be contiguous")
        if x.dtype != q_nope.dtype:
            raise ValueError(f"{name}: {x.dtype}, expected q_nope's {q_nope.dtype}")
    for name, x in (("starts", starts), ("cu_seqlens_q", cu_seqlens_q),
                    ("seq_lens", seq_lens)):
        check_int(name, x)
    if out is None:
        out = q_nope.new_empty(t, h, dv)
    check_shape("out", out, (t, h, dv))
    check(out.stride(2) == 1, "out: the last dim must be contiguous")
    check_device(q_nope, q_pe, kv, k_pe, starts, cu_seqlens_q, seq_lens, out)
    if bsz == 0 or t == 0:
        return out
    fp32 = q_nope.dtype == torch.float32
    want = tiles or (FP32_TILES if fp32 else Tiles(BLOCK_M, BLOCK_N, NUM_STAGES, NUM_WARPS))

    def launch(tl_: Tiles) -> None:
        check(t // tl_.block_m + bsz < 65536, "too many query tiles for grid dim 1")
        _mla_prefill_kernel[(h, t // tl_.block_m + bsz)](
            q_nope, q_pe, kv, k_pe, starts, cu_seqlens_q, seq_lens, out,
            q_nope.stride(0), q_nope.stride(1), q_pe.stride(0), q_pe.stride(1),
            kv.stride(0), kv.stride(1), k_pe.stride(0), out.stride(0), out.stride(1),
            scale * LOG2E, bsz, bsz.bit_length(),
            DN=dn, DR=r, DV=dv, DN_P=_pow2(dn), DR_P=_pow2(r), DV_P=_pow2(dv),
            BLOCK_M=tl_.block_m, BLOCK_N=tl_.block_n, COMPUTE=compute_dtype(q_nope), IEEE=fp32,
            num_warps=tl_.num_warps, num_stages=tl_.num_stages)

    launch_fitting(("mla_prefill", q_nope.dtype, dn, r, dv, q_nope.device), want, launch)
    return out
