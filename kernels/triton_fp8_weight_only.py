"""Triton weight-only FP8 linear for few rows (decode): y = x @ (w * scale)^T with the FP8
weight converted in registers, so the step reads one byte per weight.

Reference: kernels/ref_fp8.fp8_weight_only_ref (same signature). At one to a few rows a
projection is bound by the weight's bytes; the grid covers N in BLOCK_N columns and, when
that leaves SMs idle, K in `splits` ranges whose float32 partial sums the reader adds
(engine/models/split_k.py) or, for a caller that wants [M, N], one sum here.

Two kernels, picked per call by `config_for`:

* `_gemv_kernel` (up to GEMV_MAX_M rows): no tl.dot. Each program streams a
  [BLOCK_N, BLOCK_K] FP8 tile (16-byte loads, unmasked when the K range is whole tiles),
  widens it to float32, multiplies by up to GEMV_ROWS rows of x and sums over K into
  float32 accumulators. A tl.dot at one row pads M to 16 and, worse, Triton widens FP8 to
  bf16 through F2F.BF16.F16, a conversion-unit instruction per weight: SASS of the old
  kernel on sm_90 has 64 of them per thread per tile, and that pipe (16/clk/SM) cannot
  keep up with HBM (~18 bytes/clk/SM on an H200). FP8 -> float32 instead is F2FP (two at a
  time) plus HADD2.F32 on the FMA pipe.
* `_wo_kernel` (more rows): the tensor-core product. Its FP8 -> x.dtype conversion goes
  through float32 (CVT_F32, the same fast instructions, exact: e4m3 fits bf16 and fp16).

The committed-before tiles of `_wo_kernel` stay reachable as OLD_CONFIG, for the sweep
(bench/fp8_wo_sweep.py) to time against.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels.pdl import follow, pdl_for
from kernels.triton_common import check, check_float

# Tensor-core path (and the pre-GEMV default).
BLOCK_N = 64
BLOCK_K = 128
MAX_BLOCK_M = 64
# Programs per SM below which K is split (the weight stream needs every SM reading).
PROGRAMS_PER_SM = 2

# Rows up to which the dot-free kernel runs. Its FMA work grows with the rows (the tensor
# cores' does not): at 4 rows it is ~4 FFMA per weight byte, still under the FMA pipe's
# share at HBM rate; bench/fp8_wo_sweep.py times both kernels at 8 rows.
GEMV_MAX_M = 4
# Rows of x one GEMV program multiplies its weight tile by (separate accumulators: a
# [BLOCK_N, rows] accumulator makes Triton pick a layout that round-trips through shared
# memory every tile). Larger M takes more programs, which re-read the tile from L2.
GEMV_ROWS = 4


@dataclass(frozen=True)
class Config:
    """Launch choice for one call. kind "gemv": `_gemv_kernel` (block_m is ignored: rows
    go GEMV_ROWS to a program); kind "dot": `_wo_kernel`. even_k: use the unmasked K path
    when the split range is whole tiles; cvt_f32 (dot only): widen FP8 through float32;
    programs_per_sm: the grid size below which choose_splits splits K."""

    kind: str
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    even_k: bool = True
    cvt_f32: bool = True
    # A GEMV program keeps only its own tile's loads in flight, so the grid must put
    # several on every SM to cover HBM latency. 3, not 4: gate_up's 448 programs then run
    # unsplit, and an unsplit [M, N] output saves the caller's sum over partials (two
    # launches, engine/quant/fp8_linear.py) where no fused reader takes them.
    programs_per_sm: int = 3
    # The fewest K tiles a split range keeps. 4 lets a pipelined loop (num_stages > 1)
    # fill; an unpipelined GEMV at 1-4 rows ran as fast on 2 tiles a range on the H200.
    min_k_tiles: int = 4


# The tiles this module launched before the GEMV path (one config for every shape).
OLD_CONFIG = Config("dot", BLOCK_N, BLOCK_K, 4, 4, even_k=False, cvt_f32=False,
                    programs_per_sm=PROGRAMS_PER_SM)
DOT_CONFIG = Config("dot", BLOCK_N, BLOCK_K, 4, 4, programs_per_sm=PROGRAMS_PER_SM)
# GEMV tiles per shape class, (N >= this, K >= this) -> config, first match wins. Keys are
# classes, not exact shapes, so other models land on a neighbour. From bench/fp8_wo_sweep.py
# on one H200 (2026-12-03, bench/results/fp8_wo_sweep_h200.json), Llama-3-8B at 1 row, the
# fastest tiles that choose_splits reaches (the top few of each shape were within 3%):
# gate_up 30.5 us (93% of HBM, unsplit), down 16.8 us (4 splits), qkv 9.1 (4), o 6.8 (8);
# the first tiles here took 37.8 / 19.1 / 8.8 / 7.4 and the dot kernel 48.3 / 22.8 / 11.9 /
# 9.4.
GEMV_TABLE: tuple[tuple[int, int, Config], ...] = (
    (16384, 0, Config("gemv", 32, 256, 4, 3)),  # gate_up-like: wide N fills the SMs
    (0, 8192, Config("gemv", 16, 256, 2, 3, programs_per_sm=6)),  # down-like: long K
    (0, 0, Config("gemv", 32, 256, 4, 1, programs_per_sm=5, min_k_tiles=2)),  # qkv, o
)


def config_for(m: int, n: int, k: int, groups: int) -> Config:
    """The kernel and tiles for [m, k] x [n, k]."""
    if m > GEMV_MAX_M:
        return DOT_CONFIG
    for n_min, k_min, cfg in GEMV_TABLE:
        if n >= n_min and k >= k_min:
            return cfg
    return GEMV_TABLE[-1][2]


@triton.jit
def _wo_kernel(x_ptr, w_ptr, s_ptr, out_ptr, M, N, K, s_xm, s_wn, s_sn, s_os, s_om,
               k_per_split, GROUP_K: tl.constexpr, ONE_GROUP: tl.constexpr,
               EVEN_K: tl.constexpr, CVT_F32: tl.constexpr, PDL: tl.constexpr,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_s = tl.program_id(1)
    pid_m = tl.program_id(2)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    m_ok = rm < M
    n_ok = rn < N
    k0 = pid_s * k_per_split
    if PDL:  # x is the kernel before's output; out may reuse its memory (kernels/pdl.py)
        follow()
    k_end = tl.minimum(k0 + k_per_split, K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kk in range(k0, k_end, BLOCK_K):
        ks = kk + rk
        if EVEN_K:
            # Whole tiles: no K mask, and rows past M / N re-read the last row (clamped,
            # so in bounds) rather than being masked; their sums are never stored.
            x = tl.load(x_ptr + tl.minimum(rm, M - 1)[:, None].to(tl.int64) * s_xm
                        + ks[None, :])
            w = tl.load(w_ptr + tl.minimum(rn, N - 1)[:, None].to(tl.int64) * s_wn
                        + ks[None, :])
        else:
            k_ok = ks < k_end
            x = tl.load(x_ptr + rm[:, None].to(tl.int64) * s_xm + ks[None, :],
                        mask=m_ok[:, None] & k_ok[None, :], other=0.0)
            w = tl.load(w_ptr + rn[:, None].to(tl.int64) * s_wn + ks[None, :],
                        mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        if CVT_F32:
            # FP8 -> float32 is F2FP + HADD2.F32; straight to bf16 is one F2F each (slow).
            wt = w.to(tl.float32).to(x.dtype)
        else:
            wt = w.to(x.dtype)
        d = tl.dot(x, tl.trans(wt))
        if ONE_GROUP:
            acc += d
        else:
            sc = tl.load(s_ptr + rn * s_sn + kk // GROUP_K, mask=n_ok, other=0.0)
            acc += d * sc[None, :]
    if ONE_GROUP:
        sc = tl.load(s_ptr + rn * s_sn, mask=n_ok, other=0.0)
        acc = acc * sc[None, :]
    ptrs = out_ptr + pid_s * s_os + rm[:, None].to(tl.int64) * s_om + rn[None, :]
    tl.store(ptrs, acc.to(out_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


@triton.jit
def _row_sum(wf, x_ptrs, k_ok, EVEN_K: tl.constexpr):
    """sum over K of wf [BLOCK_N, BLOCK_K] float32 times one row of x [BLOCK_K]."""
    if EVEN_K:
        x = tl.load(x_ptrs)
    else:
        x = tl.load(x_ptrs, mask=k_ok, other=0.0)
    return tl.sum(wf * x.to(tl.float32)[None, :], axis=1)


@triton.jit
def _silu_pairs(acc, ty: tl.constexpr, BLOCK_N: tl.constexpr):
    """[BLOCK_N] sums as (gate, up) pairs -> silu(gate) * up, [BLOCK_N // 2]. gate and up
    are rounded to the output dtype first, as the unfused path stores them, so the result
    is the same bits as silu_and_mul over this kernel's [gate | up] output."""
    gate, up = tl.split(tl.reshape(acc, (BLOCK_N // 2, 2)))
    g = gate.to(ty).to(tl.float32)
    u = up.to(ty).to(tl.float32)
    return g / (1.0 + tl.exp(-g)) * u


@triton.jit
def _gemv_kernel(x_ptr, w_ptr, s_ptr, out_ptr, M, N, s_xm, s_wn, s_sn, s_os, s_om,
                 k_per_split, GROUP_K: tl.constexpr, ONE_GROUP: tl.constexpr,
                 EVEN_K: tl.constexpr, ROWS: tl.constexpr, EVICT_FIRST: tl.constexpr,
                 PDL: tl.constexpr, GLU: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, STAGES: tl.constexpr):
    # grid: (row groups, N tiles, K splits). Row groups vary fastest, so the programs that
    # share a weight tile run together and all but the first read it from L2.
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_s = tl.program_id(2)
    m0 = pid_m * ROWS
    rk = tl.arange(0, BLOCK_K)
    if GLU:
        # w is [gate | up], N = 2 * inter; the output is silu(gate) * up, [M, inter]. Tile
        # row 2c reads gate column c of this program's BLOCK_N // 2, row 2c + 1 up column c,
        # so the epilogue pairs them by a reshape, and the tile is as many rows as before.
        half = N // 2
        rc = pid_n * (BLOCK_N // 2) + tl.arange(0, BLOCK_N) // 2
        rn_ld = tl.minimum(rc, half - 1) + (tl.arange(0, BLOCK_N) % 2) * half
    else:
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        # Columns past N re-read row N - 1: every weight load is in bounds and unmasked
        # along N, so the 16-byte vectors along K survive; those sums are not stored.
        rn_ld = tl.minimum(rn, N - 1)
    k0 = pid_s * k_per_split
    if PDL:  # x is the kernel before's output; out may reuse its memory (kernels/pdl.py)
        follow()
    w_ptrs = w_ptr + rn_ld[:, None].to(tl.int64) * s_wn + (k0 + rk)[None, :]
    # x as [BLOCK_K]: Triton then moves this small vector into the weight tile's layout
    # (as [1, BLOCK_K] it was seen converting the weight tile into x's layout instead).
    x_ptrs = x_ptr + m0.to(tl.int64) * s_xm + k0 + rk
    # Rows past M (in the last group) re-read row M - 1, also unstored.
    s1 = tl.minimum(1, M - 1 - m0) * s_xm
    s2 = tl.minimum(2, M - 1 - m0) * s_xm
    s3 = tl.minimum(3, M - 1 - m0) * s_xm
    acc0 = tl.zeros((BLOCK_N,), dtype=tl.float32)
    acc1 = tl.zeros((BLOCK_N,), dtype=tl.float32)
    acc2 = tl.zeros((BLOCK_N,), dtype=tl.float32)
    acc3 = tl.zeros((BLOCK_N,), dtype=tl.float32)
    # STAGES > 1: Triton's pipeliner keeps STAGES - 1 tiles in flight through cp.async to
    # shared memory; 1: plain register loads, latency hidden by other programs.
    for kk in tl.range(0, k_per_split, BLOCK_K, num_stages=STAGES):
        k_ok = kk + rk < k_per_split
        if EVEN_K:
            if EVICT_FIRST:  # read once: keep L2 for x and the partials
                w = tl.load(w_ptrs, eviction_policy="evict_first")
            else:
                w = tl.load(w_ptrs)
        else:
            if EVICT_FIRST:
                w = tl.load(w_ptrs, mask=k_ok[None, :], other=0.0,
                            eviction_policy="evict_first")
            else:
                w = tl.load(w_ptrs, mask=k_ok[None, :], other=0.0)
        wf = w.to(tl.float32)
        if ONE_GROUP:
            acc0 += _row_sum(wf, x_ptrs, k_ok, EVEN_K)
            if ROWS > 1:
                acc1 += _row_sum(wf, x_ptrs + s1, k_ok, EVEN_K)
            if ROWS > 2:
                acc2 += _row_sum(wf, x_ptrs + s2, k_ok, EVEN_K)
                acc3 += _row_sum(wf, x_ptrs + s3, k_ok, EVEN_K)
        else:
            # Block scales: BLOCK_K divides GROUP_K, so one scale per row per tile.
            sc = tl.load(s_ptr + rn_ld * s_sn + (k0 + kk) // GROUP_K)
            acc0 += _row_sum(wf, x_ptrs, k_ok, EVEN_K) * sc
            if ROWS > 1:
                acc1 += _row_sum(wf, x_ptrs + s1, k_ok, EVEN_K) * sc
            if ROWS > 2:
                acc2 += _row_sum(wf, x_ptrs + s2, k_ok, EVEN_K) * sc
                acc3 += _row_sum(wf, x_ptrs + s3, k_ok, EVEN_K) * sc
        w_ptrs += BLOCK_K
        x_ptrs += BLOCK_K
    if ONE_GROUP:
        sc = tl.load(s_ptr + rn_ld * s_sn)
        acc0 = acc0 * sc
        acc1 = acc1 * sc
        acc2 = acc2 * sc
        acc3 = acc3 * sc
    ty = out_ptr.dtype.element_ty
    if GLU:
        hc = pid_n * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)
        n_ok = hc < half
        o_ptrs = out_ptr + m0.to(tl.int64) * s_om + hc
        acc0 = _silu_pairs(acc0, ty, BLOCK_N)
        if ROWS > 1:
            acc1 = _silu_pairs(acc1, ty, BLOCK_N)
        if ROWS > 2:
            acc2 = _silu_pairs(acc2, ty, BLOCK_N)
            acc3 = _silu_pairs(acc3, ty, BLOCK_N)
    else:
        n_ok = rn < N
        o_ptrs = out_ptr + pid_s * s_os + m0.to(tl.int64) * s_om + rn
    tl.store(o_ptrs, acc0.to(ty), mask=n_ok)
    if ROWS > 1:
        tl.store(o_ptrs + s_om, acc1.to(ty), mask=n_ok & (m0 + 1 < M))
    if ROWS > 2:
        tl.store(o_ptrs + 2 * s_om, acc2.to(ty), mask=n_ok & (m0 + 2 < M))
        tl.store(o_ptrs + 3 * s_om, acc3.to(ty), mask=n_ok & (m0 + 3 < M))


@functools.cache
def _sm_count(index: int) -> int:
    return int(torch.cuda.get_device_properties(index).multi_processor_count)


def _gemv_rows(m: int) -> int:
    return 1 if m == 1 else 2 if m == 2 else GEMV_ROWS


def _programs(m: int, n: int, cfg: Config) -> int:
    if cfg.kind == "gemv":
        return triton.cdiv(n, cfg.block_n) * triton.cdiv(m, _gemv_rows(m))
    return triton.cdiv(n, cfg.block_n) * triton.cdiv(m, _block_m(m))


def choose_splits(m: int, n: int, k: int, groups: int, sms: int) -> int:
    """K ranges for [m, k] x [n, k] on `sms` SMs: doubled while the grid is under the
    config's programs-per-SM target and each range keeps its min_k_tiles K tiles (and, for
    block scales, whole scale groups)."""
    cfg = config_for(m, n, k, groups)
    progs = _programs(m, n, cfg)
    target = cfg.programs_per_sm
    gk = k // groups
    block_k = cfg.block_k if groups == 1 else min(cfg.block_k, gk)

    def fits(s: int) -> bool:
        c = k // s
        return (k % s == 0 and c >= cfg.min_k_tiles * block_k
                and (groups == 1 or c % gk == 0))

    s = 1
    while progs * s < target * sms and fits(2 * s):
        s *= 2
    return s


def auto_splits(x: torch.Tensor, n: int, groups: int) -> int:
    """choose_splits for x on its device (1 off CUDA)."""
    if not x.is_cuda:
        return 1
    return choose_splits(x.shape[0], n, x.shape[1], groups, _sm_count(x.device.index or 0))


def _block_m(m: int) -> int:
    return min(MAX_BLOCK_M, max(16, triton.next_power_of_2(m)))


def _operands(x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor
              ) -> tuple[int, int, int, int]:
    """Checks x [M, K], w [N, K] float8_e4m3fn and w_scale [N, G]; returns (M, K, N, G)."""
    check(x.dim() == 2 and w.dim() == 2 and x.shape[1] == w.shape[1],
          "x [M, K] and w [N, K] must share K")
    check_float("x", x)
    check(w.dtype == torch.float8_e4m3fn, f"w: expected float8_e4m3fn, got {w.dtype}")
    m, k = x.shape
    n = w.shape[0]
    g = w_scale.shape[1]
    check(w_scale.shape[0] == n and k % g == 0, "w_scale: expected [N, G] with G dividing K")
    check(x.stride(1) == 1 and w.stride(1) == 1 and w_scale.stride(1) == 1,
          "x, w, w_scale: rows must be contiguous")
    return m, k, n, g


def _k_tiles(cfg: Config, k: int, g: int) -> tuple[int, int]:
    """(columns per scale group, the K tile): a block-scaled weight's K tile lies inside
    one scale group."""
    gk = k // g
    block_k = cfg.block_k if g == 1 else min(cfg.block_k, gk)
    check(g == 1 or gk % block_k == 0, f"scale groups of {gk} columns: not a multiple of "
          f"{block_k}")
    return gk, block_k


def fp8_weight_only(x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor,
                    splits: int = 1, *, config: Config | None = None) -> torch.Tensor:
    """x [M, K], w [N, K] float8_e4m3fn, w_scale [N, G] float32 -> [M, N] in x's dtype
    (splits == 1) or [splits, M, N] float32 partial sums over K / splits columns each.
    config: the kernel and tiles (default `config_for`; the sweep passes its own)."""
    m, k, n, g = _operands(x, w, w_scale)
    cfg = config or config_for(m, n, k, g)
    check(cfg.kind in ("gemv", "dot"), f"config.kind: expected 'gemv' or 'dot', got {cfg.kind}")
    gk, block_k = _k_tiles(cfg, k, g)
    check(splits >= 1 and k % splits == 0, f"splits: {splits} does not divide K={k}")
    kps = k // splits
    check(g == 1 or kps % gk == 0, f"splits: {splits} cuts a scale group of {gk} columns")
    if splits == 1:
        out = torch.empty(1, m, n, dtype=x.dtype, device=x.device)
    else:
        out = torch.empty(splits, m, n, dtype=torch.float32, device=x.device)
    if m == 0:
        return out[0] if splits == 1 else out
    even_k = cfg.even_k and kps % block_k == 0
    pdl = pdl_for(x)
    if cfg.kind == "gemv":
        rows = _gemv_rows(m)
        grid = (triton.cdiv(m, rows), triton.cdiv(n, cfg.block_n), splits)
        _gemv_kernel[grid](
            x, w, w_scale, out, m, n, x.stride(0), w.stride(0), w_scale.stride(0),
            out.stride(0), out.stride(1), kps, GROUP_K=gk, ONE_GROUP=g == 1,
            EVEN_K=even_k, ROWS=rows, EVICT_FIRST=m <= rows, PDL=pdl, GLU=False,
            BLOCK_N=cfg.block_n, BLOCK_K=block_k, STAGES=cfg.num_stages,
            num_warps=cfg.num_warps, launch_pdl=pdl)
    else:
        bm = _block_m(m)
        grid = (triton.cdiv(n, cfg.block_n), splits, triton.cdiv(m, bm))
        _wo_kernel[grid](x, w, w_scale, out, m, n, k, x.stride(0), w.stride(0),
                         w_scale.stride(0), out.stride(0), out.stride(1), kps, GROUP_K=gk,
                         ONE_GROUP=g == 1, EVEN_K=even_k, CVT_F32=cfg.cvt_f32, PDL=pdl,
                         BLOCK_M=bm, BLOCK_N=cfg.block_n, BLOCK_K=block_k,
                         num_warps=cfg.num_warps, num_stages=cfg.num_stages, launch_pdl=pdl)
    return out[0] if splits == 1 else out


def glu_config(m: int, n: int, k: int, groups: int, sms: int) -> Config | None:
    """The GEMV config that `fp8_weight_only_glu` runs [m, k] x [n, k] with, or None where
    the product would not run as one unsplit GEMV (more rows than GEMV_MAX_M, or a grid
    small enough that choose_splits cuts K: the activation needs whole sums)."""
    cfg = config_for(m, n, k, groups)
    if cfg.kind != "gemv" or n % 2 or choose_splits(m, n, k, groups, sms) != 1:
        return None
    return cfg


def auto_glu_config(x: torch.Tensor, n: int, groups: int) -> Config | None:
    """glu_config for x on its CUDA device."""
    return glu_config(x.shape[0], n, x.shape[1], groups, _sm_count(x.device.index or 0))


def fp8_weight_only_glu(x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor, *,
                        config: Config | None = None) -> torch.Tensor:
    """silu(gate) * up of x @ (w * scale)^T, w = [gate | up] [2I, K] float8_e4m3fn ->
    [M, I] in x's dtype: the GEMV with the activation in its epilogue, so the [M, 2I]
    product is never stored and the MLP's activation launch goes. Equal, bit for bit, to
    silu_and_mul(fp8_weight_only(x, w, w_scale)) with the same config (both round gate
    and up to x's dtype first). config: a "gemv" Config (default `config_for`)."""
    m, k, n, g = _operands(x, w, w_scale)
    check(n % 2 == 0, f"w: expected [2I, K] = [gate | up], got {n} rows")
    cfg = config or config_for(m, n, k, g)
    check(cfg.kind == "gemv", f"config.kind: the fused activation runs in the GEMV only, "
          f"got {cfg.kind}")
    check(cfg.block_n % 2 == 0, f"config.block_n: expected even, got {cfg.block_n}")
    gk, block_k = _k_tiles(cfg, k, g)
    out = torch.empty(m, n // 2, dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    pdl = pdl_for(x)
    rows = _gemv_rows(m)
    grid = (triton.cdiv(m, rows), triton.cdiv(n // 2, cfg.block_n // 2), 1)
    _gemv_kernel[grid](
        x, w, w_scale, out, m, n, x.stride(0), w.stride(0), w_scale.stride(0),
        0, out.stride(0), k, GROUP_K=gk, ONE_GROUP=g == 1,
        EVEN_K=cfg.even_k and k % block_k == 0, ROWS=rows, EVICT_FIRST=m <= rows, PDL=pdl,
        GLU=True, BLOCK_N=cfg.block_n, BLOCK_K=block_k, STAGES=cfg.num_stages,
        num_warps=cfg.num_warps, launch_pdl=pdl)
    return out
