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

