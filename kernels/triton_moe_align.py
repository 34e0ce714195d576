"""The align step of the fused MoE kernel (kernels/triton_moe.py, step 1): the (token,
expert) pairs of a call sorted by expert, each expert's run padded to the row tile.

Three implementations of one result (bit-identical, stable order within an expert):
* `moe_align`: torch ops, any size. The plain-torch reference, and the one the others are
  tested against; on a GPU it is a dozen+ small kernels (a radix sort among them).
* `moe_align_triton`: one Triton program, for decode-sized calls, where those launches
  would cost more than the GEMMs'. One program walks every pair, so it does not scale.
* `moe_align_multi`: a counting sort in three grid launches (count per chunk of pairs,
  prefix over chunks per expert, place), for prefill-sized calls: there the torch ops
  were ~25 launches a layer, ~1.5 ms of an H200's time in a 26-layer 4,096-token x 8-pair
  prefill, their host time showing as gaps between kernels.
None reads a device value on the host: every size is a bound from shapes, so all can run
inside a CUDA graph.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.pdl import follow, pdl_for


def max_sorted_rows(num_pairs: int, num_local: int, block_m: int) -> int:
    """Rows of the padded, expert-sorted layout: a bound from shapes (an expert with c
    pairs needs ceil(c / BM) tiles; at most min(N, E_local) experts are non-empty)."""
    rows = num_pairs + min(num_pairs, num_local) * (block_m - 1)
    return triton.cdiv(rows, block_m) * block_m


def moe_align(topk_ids: torch.Tensor, block_m: int, expert_start: int,
              num_local: int) -> tuple[torch.Tensor, torch.Tensor]:
    """topk_ids [T, k] global ids -> (sorted_ids [P] int32, block_expert [P / BM] int32).
    Pairs keep their order within an expert (a stable sort), so the layout is a pure
    function of topk_ids."""
    n = topk_ids.numel()
    dev = topk_ids.device
    p = max_sorted_rows(n, num_local, block_m)
    ids = topk_ids.reshape(-1).to(torch.int64) - expert_start  # [N]
    valid = (ids >= 0) & (ids < num_local)
    key = torch.where(valid, ids, num_local)  # [N]; bucket E_local: another rank's pair
    counts = torch.zeros(num_local + 1, dtype=torch.int64, device=dev)
    counts.scatter_add_(0, key, torch.ones_like(key))  # [E+1]; bincount would sync
    padded = (counts + block_m - 1) // block_m * block_m  # [E+1]
    padded[num_local:].zero_()  # a fill kernel: `[i] = 0` copies a host scalar (no graphs)
    pad_end = torch.cumsum(padded, 0)  # [E+1]
    pad_start = pad_end - padded
    run_start = torch.cumsum(counts, 0) - counts  # [E+1]: unpadded run starts
    order = torch.sort(key, stable=True).indices  # [N] pair ids grouped by expert
    skey = key[order]
    rank = torch.arange(n, device=dev) - run_start[skey]  # position within the expert's run
    # other ranks' pairs all land in one dump row past the end, sliced off
    dest = torch.where(skey < num_local, pad_start[skey] + rank, p)  # [N]
    sorted_ids = torch.full((p + 1,), n, dtype=torch.int32, device=dev)
    sorted_ids.scatter_(0, dest, order.to(torch.int32))
    starts = torch.arange(0, p, block_m, device=dev)  # [P / BM] first row of each tile
    block_expert = torch.searchsorted(pad_end[:num_local], starts, right=True)
    block_expert = torch.where(starts < pad_end[num_local - 1], block_expert, -1)
    return sorted_ids[:p], block_expert.to(torch.int32)


# Up to this many (token, expert) pairs the align step is one Triton program
# (moe_align_triton, one launch); past it, moe_align_multi's three launches (the same layout,
# bit for bit: tests/kernels/test_moe_align.py). The one program walks every pair, 64 at a
# time, in series: ~48 µs a layer at 1,024 pairs on an H100 (DeepSeek-V2-Lite at batch 128,
# its 2 shared experts folded in: 8 pairs a token), where the three launches take ~8 (the
# step's saving subtracted). Graphed decode step on an H100, every call through the three
# launches against the one program up to 2,048 pairs (bench/RESULTS.md, "... the align
# step's form at decode"): V2-Lite batch 128 (1,024 pairs) 0.934, 32 (256) 0.990, 8 (64)
# 1.012; Qwen3-30B-A3B batch 128 (1,024) 0.936, 32 (256) 0.997. Whether one program beats
# three launches is the align kernels' property, not the caller's, so every form of the
# fused MoE reads this one bound (one_program). The prefill forms (kernels/
# moe_grouped_gemm.py, kernels/triton_moe_tma.py) had a bound of their own, 2,048, which a
# top-1 or top-2 routing reached at their 1,024 tokens (Mixtral's 2,048 pairs: ~100 µs a
# layer in series at the rate above).
ALIGN_ONE_PROGRAM_MAX_PAIRS = 128
ALIGN_CHUNK = 64  # pairs per inner step: the one-hot tile is [ALIGN_CHUNK, E_local]


@triton.jit
def _store_tile_experts(bexp_ptr, t0, NUM_TILES, pad_end, total, es, num_local,
                        BLOCK_M: tl.constexpr, BLOCK_T: tl.constexpr):
    """block_expert for tiles t0 .. t0 + BLOCK_T: the local expert whose padded run holds
    each tile's first row (the runs ending at or before it, counted), -1 past the runs.
    pad_end [BLOCK_E]: each expert's padded run end; total: where the runs end."""
    tiles = t0 + tl.arange(0, BLOCK_T)
    starts = tiles * BLOCK_M
    ended = (pad_end[None, :] <= starts[:, None]) & (es[None, :] < num_local)
    ex = tl.sum(ended.to(tl.int32), axis=1)
    ex = tl.where(starts < total, ex, -1)
    tl.store(bexp_ptr + tiles, ex, mask=tiles < NUM_TILES)


@triton.jit
def _align_kernel(ids_ptr, sorted_ptr, bexp_ptr, N, P, NUM_TILES, expert_start, num_local,
                  BLOCK_E: tl.constexpr, CHUNK: tl.constexpr, BLOCK_M: tl.constexpr,
                  BLOCK_T: tl.constexpr, PDL: tl.constexpr):
    """moe_align in one program: count pairs per expert, lay out the padded runs, place
    every pair (stable: earlier pairs first), and name each tile's expert."""
    if PDL:  # the routing's ids are the kernel before's output (kernels/pdl.py)
        follow()
    es = tl.arange(0, BLOCK_E)
    counts = tl.zeros([BLOCK_E], dtype=tl.int32)
    for n0 in range(0, N, CHUNK):
        offs = n0 + tl.arange(0, CHUNK)
        e = tl.load(ids_ptr + offs, mask=offs < N, other=0).to(tl.int32) - expert_start
        e = tl.where((offs < N) & (e >= 0) & (e < num_local), e, BLOCK_E)  # BLOCK_E: none
        counts += tl.sum((e[:, None] == es[None, :]).to(tl.int32), axis=0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M  # [BE]
    pad_end = tl.cumsum(padded, axis=0)
    total = tl.sum(padded, axis=0)
    for p0 in range(0, P, CHUNK):  # every row padding first; pairs overwrite theirs below
        rows = p0 + tl.arange(0, CHUNK)
        tl.store(sorted_ptr + rows, tl.full([CHUNK], 0, tl.int32) + N, mask=rows < P)
    tl.debug_barrier()  # the fill lands before any thread places a pair over it
    cursor = pad_end - padded  # [BE] next free row of each expert's run
    for n0 in range(0, N, CHUNK):
        offs = n0 + tl.arange(0, CHUNK)
        e = tl.load(ids_ptr + offs, mask=offs < N, other=0).to(tl.int32) - expert_start
        ok = (offs < N) & (e >= 0) & (e < num_local)
        onehot = (tl.where(ok, e, BLOCK_E)[:, None] == es[None, :]).to(tl.int32)  # [C, BE]
        before = tl.cumsum(onehot, axis=0) - onehot  # same-expert pairs earlier in the chunk
        pos = tl.sum((cursor[None, :] + before) * onehot, axis=1)  # [C]
        tl.store(sorted_ptr + pos, offs.to(tl.int32), mask=ok)
        cursor += tl.sum(onehot, axis=0)
    for t0 in range(0, NUM_TILES, BLOCK_T):
        _store_tile_experts(bexp_ptr, t0, NUM_TILES, pad_end, total, es, num_local, BLOCK_M,
                            BLOCK_T)


def one_program(num_pairs: int) -> bool:
    """Whether a call of num_pairs pairs aligns in one program (moe_align_triton) rather
    than in moe_align_multi's three launches. The bound is read at call time, so a bench's
    variant or a test may set it (bench/moe_bench.py --variants "kernels.triton_moe_align.
    ALIGN_ONE_PROGRAM_MAX_PAIRS=2048")."""
    return num_pairs <= ALIGN_ONE_PROGRAM_MAX_PAIRS


def moe_align_triton(topk_ids: torch.Tensor, block_m: int, expert_start: int,
                     num_local: int) -> tuple[torch.Tensor, torch.Tensor]:
    """moe_align's result from one Triton program (for up to ALIGN_ONE_PROGRAM_MAX_PAIRS)."""
    n = topk_ids.numel()
    p = max_sorted_rows(n, num_local, block_m)
    sorted_ids = torch.empty(p, dtype=torch.int32, device=topk_ids.device)
    block_expert = torch.empty(p // block_m, dtype=torch.int32, device=topk_ids.device)
    pdl = pdl_for(topk_ids)
    _align_kernel[(1,)](
        topk_ids.reshape(-1), sorted_ids, block_expert, n, p, p // block_m, expert_start,
        num_local, BLOCK_E=triton.next_power_of_2(num_local), CHUNK=ALIGN_CHUNK,
        BLOCK_M=block_m, BLOCK_T=64, PDL=pdl, num_warps=8, launch_pdl=pdl)
    return sorted_ids, block_expert


# moe_align_multi: a program's one-hot of its chunk is [CHUNK, BLOCK_E] int32, as the single
# program's is [ALIGN_CHUNK, BLOCK_E]; this many elements at 8 warps is the single program's
# 64 x 256, which ptxas fits without spills (tests/kernels/test_moe_align_sm90.py). Wider
# chunks for fewer experts make fewer chunks for the scan to walk.
MULTI_ONEHOT = 64 * 256
MULTI_CHUNK_MIN, MULTI_CHUNK_MAX = 16, 128
SCAN_E = 32  # experts per program of the scan: 258 experts (DeepSeek-V3's + 2) are 9
SCAN_C = 128  # chunks per step of the scan's loop: [SCAN_C, SCAN_E] per step
FILL_ROWS = 1024  # padding rows per store of the count kernel's fill
PLACE_T = 16  # tiles per step of the place kernel's block_expert loop


def multi_chunk(num_local: int) -> int:
    """Pairs per program of moe_align_multi's count and place kernels."""
    return max(MULTI_CHUNK_MIN, min(MULTI_CHUNK_MAX,
                                    MULTI_ONEHOT // triton.next_power_of_2(num_local)))


@triton.jit
def _local_experts(ids_ptr, offs, N, expert_start, num_local, BLOCK_E: tl.constexpr):
    """Each pair's local expert; BLOCK_E (no expert's column) for another rank's or past N."""
    e = tl.load(ids_ptr + offs, mask=offs < N, other=0).to(tl.int32) - expert_start
    return tl.where((offs < N) & (e >= 0) & (e < num_local), e, BLOCK_E)


@triton.jit
def _multi_count_kernel(ids_ptr, counts_ptr, sorted_ptr, N, P, expert_start, num_local,
                        BLOCK_E: tl.constexpr, CHUNK: tl.constexpr, FILL: tl.constexpr,
                        PDL: tl.constexpr):
    """Launch 1 of 3: chunk c's pairs per local expert, counts[c, :]; and every sorted row
    padding (N), which launch 3 overwrites with the pairs: a separate launch, so the fill
    has landed before any pair's store (with PDL too: launch 3 waits for launch 2 to
    complete, and launch 2 waited for this one)."""
    if PDL:  # the routing's ids are the kernel before's output (kernels/pdl.py)
        follow()
    c = tl.program_id(0)
    es = tl.arange(0, BLOCK_E)
    e = _local_experts(ids_ptr, c * CHUNK + tl.arange(0, CHUNK), N, expert_start, num_local,
                       BLOCK_E)
    counts = tl.sum((e[:, None] == es[None, :]).to(tl.int32), axis=0)
    tl.store(counts_ptr + c * num_local + es, counts, mask=es < num_local)
    for r0 in range(c * FILL, P, tl.num_programs(0) * FILL):
        rows = r0 + tl.arange(0, FILL)
        tl.store(sorted_ptr + rows, tl.full([FILL], 0, tl.int32) + N, mask=rows < P)


@triton.jit
def _multi_scan_kernel(counts_ptr, base_ptr, total_ptr, num_chunks, num_local,
                       SCAN_E: tl.constexpr, SCAN_C: tl.constexpr, PDL: tl.constexpr):
    """Launch 2 of 3, a program per SCAN_E experts: base[c, e], the pairs of expert e in
    chunks before c (where chunk c's pairs start within e's run), and total[e]. A loop
    over chunk blocks: no [num_chunks, E] tile, whatever the call's size."""
    if PDL:
        follow()
    es = tl.program_id(0) * SCAN_E + tl.arange(0, SCAN_E)
    running = tl.zeros([SCAN_E], dtype=tl.int32)
    for c0 in range(0, num_chunks, SCAN_C):
        cs = c0 + tl.arange(0, SCAN_C)
        ok = (cs < num_chunks)[:, None] & (es < num_local)[None, :]
        at = cs[:, None] * num_local + es[None, :]
        cnt = tl.load(counts_ptr + at, mask=ok, other=0)
        tl.store(base_ptr + at, running[None, :] + tl.cumsum(cnt, axis=0) - cnt, mask=ok)
        running += tl.sum(cnt, axis=0)
    tl.store(total_ptr + es, running, mask=es < num_local)


@triton.jit
def _multi_place_kernel(ids_ptr, base_ptr, total_ptr, sorted_ptr, bexp_ptr, ends_ptr, map_ptr,
                        N, NUM_TILES, expert_start, num_local, BLOCK_E: tl.constexpr,
                        CHUNK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_T: tl.constexpr,
                        RUNS: tl.constexpr, PDL: tl.constexpr):
    """Launch 3 of 3: each pair of chunk c to its row, its expert's padded run start +
    base[c, e] + same-expert pairs earlier in the chunk (stable: earlier pairs first);
    and a share of the tiles' experts. Every program lays out the runs from the totals
    itself (E values), which saves a launch for it. RUNS: also each local expert's run end
    (ends [E_local], program 0) and each pair's row (map [N]; other ranks' pairs unset),
    which the grouped-GEMM form (kernels/moe_grouped_gemm.py) takes as they are."""
    if PDL:
        follow()
    c = tl.program_id(0)
    es = tl.arange(0, BLOCK_E)
    count = tl.load(total_ptr + es, mask=es < num_local, other=0)  # pairs per expert
    padded = (count + BLOCK_M - 1) // BLOCK_M * BLOCK_M  # [BE]
    pad_end = tl.cumsum(padded, axis=0)
    total = tl.sum(padded, axis=0)
    base = tl.load(base_ptr + c * num_local + es, mask=es < num_local, other=0)
    start = pad_end - padded + base  # [BE] chunk c's first row in each expert's run
    offs = c * CHUNK + tl.arange(0, CHUNK)
    e = _local_experts(ids_ptr, offs, N, expert_start, num_local, BLOCK_E)
    onehot = (e[:, None] == es[None, :]).to(tl.int32)  # [C, BE]
    before = tl.cumsum(onehot, axis=0) - onehot
    pos = tl.sum((start[None, :] + before) * onehot, axis=1)  # [C]
    tl.store(sorted_ptr + pos, offs.to(tl.int32), mask=e < BLOCK_E)
    if RUNS:
        tl.store(map_ptr + offs, pos, mask=e < BLOCK_E)
        if c == 0:
            tl.store(ends_ptr + es, pad_end, mask=es < num_local)
    for t0 in range(c * BLOCK_T, NUM_TILES, tl.num_programs(0) * BLOCK_T):
        _store_tile_experts(bexp_ptr, t0, NUM_TILES, pad_end, total, es, num_local, BLOCK_M,
                            BLOCK_T)


def moe_align_multi(topk_ids: torch.Tensor, block_m: int, expert_start: int,
                    num_local: int, runs: tuple[torch.Tensor, torch.Tensor] | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """moe_align's result as a counting sort in three grid launches (any size; for
    prefill-sized calls). runs: (ends [E_local] int32, row_of_pair [N] int32) to fill as
    well: each local expert's padded run end, and each local pair's row in sorted_ids
    (another rank's pair's entry is left as it was)."""
    n = topk_ids.numel()
    dev = topk_ids.device
    p = max_sorted_rows(n, num_local, block_m)
    sorted_ids = torch.empty(p, dtype=torch.int32, device=dev)
    block_expert = torch.empty(p // block_m, dtype=torch.int32, device=dev)
    if runs is not None:
        ends, row_of_pair = runs
        assert ends.shape == (num_local,) and ends.dtype == torch.int32, "runs: ends [E] int32"
        assert row_of_pair.shape == (n,) and row_of_pair.dtype == torch.int32, (
            "runs: row_of_pair [N] int32")
    if n == 0:  # no chunks: a grid of none
        if runs is not None:
            runs[0].zero_()  # every run empty
        return sorted_ids, block_expert
    block_e = triton.next_power_of_2(num_local)
    chunk = multi_chunk(num_local)
    chunks = triton.cdiv(n, chunk)
    # one allocation: counts, then base, [chunks, E] each, then total [E]
    work = torch.empty(2 * chunks * num_local + num_local, dtype=torch.int32, device=dev)
    counts, base = work[:chunks * num_local], work[chunks * num_local:2 * chunks * num_local]
    total = work[2 * chunks * num_local:]
    ids = topk_ids.reshape(-1)
    pdl = pdl_for(topk_ids)
    _multi_count_kernel[(chunks,)](
        ids, counts, sorted_ids, n, p, expert_start, num_local, BLOCK_E=block_e,
        CHUNK=chunk, FILL=FILL_ROWS, PDL=pdl, num_warps=8, launch_pdl=pdl)
    _multi_scan_kernel[(triton.cdiv(num_local, SCAN_E),)](
        counts, base, total, chunks, num_local, SCAN_E=SCAN_E, SCAN_C=SCAN_C, PDL=pdl,
        num_warps=4, launch_pdl=pdl)
    ends_arg, map_arg = runs if runs is not None else (total, total)  # unread without RUNS
    _multi_place_kernel[(chunks,)](
        ids, base, total, sorted_ids, block_expert, ends_arg, map_arg, n, p // block_m,
        expert_start, num_local, BLOCK_E=block_e, CHUNK=chunk, BLOCK_M=block_m,
        BLOCK_T=PLACE_T, RUNS=runs is not None, PDL=pdl, num_warps=8, launch_pdl=pdl)
    return sorted_ids, block_expert
