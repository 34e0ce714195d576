"""How a split-K decode kernel spreads one request's context over its splits when the host
does not know the lengths (a CUDA graph's grid is fixed at capture, sized for the block
table's capacity): each program reads its request's length and takes an even share, in
whole tiles, of at least the launch's least split size. The decode kernels and their merges
call the same rule, so a merge finds exactly the splits its decode kernel wrote."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def request_split_len(seq_len, least, num_splits, BLOCK_N: tl.constexpr):
    """A request's context evenly over the splits it needs, each at least `least` tokens."""
    even = tl.cdiv(tl.cdiv(seq_len, num_splits), BLOCK_N) * BLOCK_N
    return tl.maximum(even, least)


@triton.jit
def split_range(lens_ptr, b, split, split_len, num_splits, BLOCK_N: tl.constexpr,
                DYN: tl.constexpr):
    """Request b's length, its split size, and the [start, end) of its context that split
    `split` reads (DYN: the split_len given is the least per split, and the request sizes
    its own, which is the one returned: what counts the splits that hold tokens)."""
    seq_len = tl.load(lens_ptr + b).to(tl.int32)
    if DYN:
        split_len = request_split_len(seq_len, split_len, num_splits, BLOCK_N)
    start = split * split_len
    return seq_len, split_len, start, tl.minimum(start + split_len, seq_len)


@triton.jit
def splits_holding(seq_len, split_len, num_splits):
    """How many of a request's splits hold tokens, given its own split size (split_range's):
    the rest write no partial, so a merge must neither wait for nor read them."""
    return tl.minimum(tl.cdiv(seq_len, split_len), num_splits)


@triton.jit
def request_splits_holding(lens_ptr, b, split_len, num_splits, BLOCK_N: tl.constexpr,
                           DYN: tl.constexpr):
    """splits_holding for request b, from the launch's split_len as its decode kernel had
    it (DYN: the least per split, and the request sizes its own as split_range does)."""
    seq_len = tl.load(lens_ptr + b).to(tl.int32)
    if DYN:
        split_len = request_split_len(seq_len, split_len, num_splits, BLOCK_N)
    return splits_holding(seq_len, split_len, num_splits)


@triton.jit
def head_block_split(lens_ptr, split_len, num_splits, H, BLOCK_H: tl.constexpr,
                     BLOCK_N: tl.constexpr, DYN: tl.constexpr):
    """A (request, head block, split) program's coordinates, as the MLA decode forms lay
    out their grids: request b, split, the request's length and its split's [start, end),
    and the block's query heads with their mask."""
    b = tl.program_id(0)
    split = tl.program_id(2)
    seq_len, _, start, end = split_range(lens_ptr, b, split, split_len, num_splits, BLOCK_N,
                                         DYN)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    return b, split, seq_len, start, end, h, h < H
