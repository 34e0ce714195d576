"""Tile configs that fit the device's shared memory, per dtype and head dim.

The attention kernels' default tiles were tuned for bf16; float32 doubles every tile's
bytes, and head dim 128 doubles them again, which overflowed an H200's 232,448 bytes per
block. Each launcher asks ``fit_attention_tiles`` for the largest config at or below its
request that the estimate says fits, and ``launch_fitting`` backs that estimate with the
compiler's own verdict: an ``OutOfResources`` shrinks the config and retries, and the
config that worked is remembered per (kernel, dtype, head dim, device).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch

# Scratch the compiler adds beyond the tiles (barriers, reductions); from the measured
# 263,424 B of BLOCK_M=256 BLOCK_N=64 fp32 D=128 3 stages, 1,280 B over the tile bytes.
SMEM_SLACK = 4096
MIN_BLOCK = 16


@dataclass(frozen=True)
class Tiles:
    block_m: int  # query rows per program (decode: the padded query-head group)
    block_n: int  # keys per inner-loop tile
    num_stages: int
    num_warps: int


@functools.cache
def max_shared_mem(device: torch.device) -> int:
    """Bytes of shared memory one block may use; unbounded in the CPU interpreter."""
    if device.type != "cuda":
        return 1 << 40
    import triton

    idx = device.index if device.index is not None else torch.cuda.current_device()
    props = triton.runtime.driver.active.utils.get_device_properties(idx)
    return int(props["max_shared_mem"])


def smem_bytes(t: Tiles, head_dim: int, elem_size: int) -> int:
    """Estimated shared memory of a paged attention program: the query tile, plus K and V
    tiles for each software-pipeline stage but the one in registers."""
    kv = 2 * t.block_n * head_dim * elem_size * max(1, t.num_stages - 1)
    return kv + t.block_m * head_dim * elem_size + SMEM_SLACK


def shrink(t: Tiles, min_block_m: int = MIN_BLOCK) -> Tiles | None:
    """The next smaller config: fewer stages first (cheapest), then key tiles, then query
    tiles; None when nothing is left to shrink."""
    if t.num_stages > 2:
        return replace(t, num_stages=t.num_stages - 1)
    if t.block_n > 32:
        return replace(t, block_n=t.block_n // 2)
    if t.block_m > max(min_block_m, 64):
        return replace(t, block_m=t.block_m // 2)
    if t.block_n > MIN_BLOCK:
        return replace(t, block_n=t.block_n // 2)
    if t.block_m > min_block_m:
        return replace(t, block_m=t.block_m // 2)
    return None


def fit_attention_tiles(want: Tiles, head_dim: int, dtype: torch.dtype, device: torch.device,
                        min_block_m: int = MIN_BLOCK, limit: int | None = None) -> Tiles:
    """The first config from ``want`` down the shrink ladder whose estimate fits ``limit``
    (default: the device's)."""
    limit = max_shared_mem(device) if limit is None else limit
    elem = torch.empty((), dtype=dtype).element_size()
    t = want
    while smem_bytes(t, head_dim, elem) > limit:
        nxt = shrink(t, min_block_m)
        if nxt is None:
            break  # the compiler has the last word; launch_fitting reports it
        t = nxt
    return t


_WORKED: dict[tuple[Any, ...], Tiles] = {}


def launch_fitting(key: tuple[Any, ...], tiles: Tiles, launch: Callable[[Tiles], None],
                   min_block_m: int = MIN_BLOCK) -> Tiles:
    """Runs ``launch(tiles)``, shrinking on the compiler's OutOfResources until one fits;
    later calls with the same key start from the config that worked."""
    from triton.runtime.errors import OutOfResources

    t = _WORKED.get((key, tiles), tiles)
    while True:
        try:
            launch(t)
        except OutOfResources:
            nxt = shrink(t, min_block_m)
            if nxt is None:
                raise
            t = nxt
            continue
        _WORKED[(key, tiles)] = t
        return t
