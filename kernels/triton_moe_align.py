"""The align step of the fused MoE kernel (kernels/triton_moe.py, step 1): the (token,
expert) pairs of a call sorted by expert, each expert's run padded to the row tile.

`moe_align` is torch ops (any size; a dozen small kernels); `moe_align_triton` is one
Triton program with the same result, for decode-sized calls, where those launches would
cost more than the GEMMs'. Neither reads a device value on the host: every size is a bound
from shapes, so both can run inside a CUDA graph.
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


# Up to this many (token, expert) pairs the align step is one Triton program (one launch in
# place of the dozen small torch ops, which at decode would cost more than the GEMMs' own
# launches); past it, the torch ops, whose launches a prefill's GEMMs amortize.
ALIGN_KERNEL_MAX_PAIRS = 2048
ALIGN_CHUNK = 64  # pairs per inner step: the one-hot tile is [ALIGN_CHUNK, E_local]


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
        tiles = t0 + tl.arange(0, BLOCK_T)
        starts = tiles * BLOCK_M
        # the expert whose padded run holds the tile's first row: runs ending at or before
        ended = (pad_end[None, :] <= starts[:, None]) & (es[None, :] < num_local)
        ex = tl.sum(ended.to(tl.int32), axis=1)
        ex = tl.where(starts < total, ex, -1)
        tl.store(bexp_ptr + tiles, ex, mask=tiles < NUM_TILES)


def moe_align_triton(topk_ids: torch.Tensor, block_m: int, expert_start: int,
                     num_local: int) -> tuple[torch.Tensor, torch.Tensor]:
    """moe_align's result from one Triton program (for up to ALIGN_KERNEL_MAX_PAIRS)."""
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
