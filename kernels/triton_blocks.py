"""Triton ``gather_blocks`` / ``scatter_blocks``: pack whole KV blocks into a contiguous
staging buffer and back (see ref_kv.py), for transfer paths that cannot read the cache
in place.

A block is every element of ``cache[b]``; its inner dims must be contiguous (the engine's
block-major cache is: one block holds every layer), so a block is copied as a flat run.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from kernels.triton_common import check, check_device, check_int, inner_contiguous

# 16 KiB of bf16 per program: big enough that per-program overhead (the block-id load) is
# noise, small enough that even a one-block copy spreads over many SMs.
_BLOCK = 8192


@triton.jit
def _copy_blocks_kernel(
    src_ptr, dst_ptr, ids_ptr,
    s_src, s_dst,  # dim-0 strides, in elements
    NUMEL, GATHER: tl.constexpr, BLOCK: tl.constexpr,
):
    i = tl.program_id(0)
    chunk = tl.program_id(1)
    blk = tl.load(ids_ptr + i).to(tl.int64)
    offs = chunk * BLOCK + tl.arange(0, BLOCK)
    mask = offs < NUMEL
    if GATHER:  # cache[blk] -> staging[i]
        src = src_ptr + blk * s_src
        dst = dst_ptr + i.to(tl.int64) * s_dst
    else:  # staging[i] -> cache[blk]
        src = src_ptr + i.to(tl.int64) * s_src
        dst = dst_ptr + blk * s_dst
    x = tl.load(src + offs, mask=mask)
    tl.store(dst + offs, x, mask=mask)


def _launch(src: torch.Tensor, dst: torch.Tensor, block_ids: torch.Tensor, gather: bool) -> None:
    check(src.dtype == dst.dtype, f"dtype mismatch: {src.dtype} vs {dst.dtype}")
    check(src.shape[1:] == dst.shape[1:], f"block shape mismatch: {tuple(src.shape[1:])} vs "
          f"{tuple(dst.shape[1:])}")
    check(inner_contiguous(src) and inner_contiguous(dst),
          "every dim but the block dim must be contiguous")
    check(block_ids.dim() == 1, "block_ids: expected [N]")
    check_int("block_ids", block_ids)
    check_device(src, dst, block_ids)
    n = block_ids.numel()
    numel = math.prod(src.shape[1:])
    if n == 0 or numel == 0:
        return
    grid = (n, triton.cdiv(numel, _BLOCK))
    _copy_blocks_kernel[grid](src, dst, block_ids, src.stride(0), dst.stride(0), numel,
                              GATHER=gather, BLOCK=_BLOCK, num_warps=8)


def gather_blocks(
    cache: torch.Tensor,  # [NB, *block_shape]
    block_ids: torch.Tensor,  # [N] int32/int64
    out: torch.Tensor | None = None,  # [N, *block_shape]
) -> torch.Tensor:
    if out is None:
        out = torch.empty((block_ids.numel(), *cache.shape[1:]), dtype=cache.dtype,
                          device=cache.device)
    check(out.shape[0] == block_ids.numel(), "out: expected one row per block id")
    _launch(cache, out, block_ids, gather=True)
    return out


def scatter_blocks(
    src: torch.Tensor,  # [N, *block_shape]
    cache: torch.Tensor,  # [NB, *block_shape]
    block_ids: torch.Tensor,  # [N] int32/int64, no repeats (which copy wins is undefined)
) -> None:
    check(src.shape[0] == block_ids.numel(), "src: expected one row per block id")
    _launch(src, cache, block_ids, gather=False)


@triton.jit
def _copy_pairs_kernel(src_ptr, dst_ptr, ids_ptr, N, NUMEL, BLOCK: tl.constexpr):
    i = tl.program_id(0)
    chunk = tl.program_id(1)
    s = tl.load(ids_ptr + i).to(tl.int64)  # ids: [2, N], row 0 source, row 1 destination
    d = tl.load(ids_ptr + N + i).to(tl.int64)
    offs = chunk * BLOCK + tl.arange(0, BLOCK)
    mask = offs < NUMEL
    x = tl.load(src_ptr + s * NUMEL + offs, mask=mask)
    tl.store(dst_ptr + d * NUMEL + offs, x, mask=mask)


def copy_block_pairs(src: object, dst: object, ids: torch.Tensor, block_words: int) -> None:
    """dst block ids[1][i] <- src block ids[0][i], for every i, in one launch.

    ``src`` / ``dst``: int64 tensors over whole pools, or any object with ``data_ptr()``
    and ``dtype`` torch.int64 (a peer's pool mapped through CUDA IPC has no tensor);
    ``block_words``: 8-byte words per block. One launch for a whole announce of scattered
    runs, where one DMA copy per run pays a few microseconds of setup per 2 MiB block.
    """
    for name, t in (("src", src), ("dst", dst)):
        check(getattr(t, "dtype", None) == torch.int64, f"{name}: expected int64 words")
    check(ids.dim() == 2 and ids.shape[0] == 2, "ids: expected [2, N]")
    check_int("ids", ids)
    check(block_words > 0, "block_words: must be > 0")
    n = ids.shape[1]
    if n == 0:
        return
    block = 4096  # 32 KiB per program
    grid = (n, triton.cdiv(block_words, block))
    _copy_pairs_kernel[grid](src, dst, ids, n, block_words, BLOCK=block, num_warps=8)
