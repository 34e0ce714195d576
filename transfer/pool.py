"""A worker's KV pool as byte regions: block runs and zero-copy views into the pool tensor."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from engine.kv_layout import KVLayout

_TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class TransferValueError(ValueError):
    """Bad block ids or pool given by the caller."""


@dataclass(frozen=True)
class BlockRun:
    """Adjacent source blocks going to adjacent destination blocks: one message."""

    src_start: int  # first source block id
    dst_start: int  # first destination block id
    num_blocks: int


def block_runs(src: Sequence[int], dst: Sequence[int]) -> list[BlockRun]:
    """Splits a block table pair into maximal runs contiguous on both sides."""
    if len(src) != len(dst):
        raise TransferValueError(f"src_block_ids and dst_block_ids differ in length: "
                                 f"{len(src)} != {len(dst)}")
    runs: list[BlockRun] = []
    for s, d in zip(src, dst, strict=True):
        last = runs[-1] if runs else None
        if last and s == last.src_start + last.num_blocks and d == last.dst_start + last.num_blocks:
            runs[-1] = BlockRun(last.src_start, last.dst_start, last.num_blocks + 1)
        else:
            runs.append(BlockRun(s, d, 1))
    return runs


class KVPool:
    """Owns no memory: views the engine's pool tensor as bytes, block by block."""

    def __init__(self, tensor: torch.Tensor, layout: KVLayout) -> None:
        want = (layout.num_blocks, *layout.block_shape)
        if tuple(tensor.shape) != want:
            raise TransferValueError(f"pool shape {tuple(tensor.shape)} != layout {want}")
        if tensor.dtype != _TORCH_DTYPES[layout.dtype]:
            raise TransferValueError(f"pool dtype {tensor.dtype} != layout {layout.dtype}")
        if not tensor.is_contiguous():
            raise TransferValueError("pool tensor must be contiguous (block i = one byte range)")
        self.tensor = tensor
        self.layout = layout
        self.block_nbytes = layout.block_nbytes
        self.flat = tensor.view(-1).view(torch.uint8)  # [pool_nbytes] aliasing the pool
        self.is_cuda = tensor.is_cuda
        self.device_index = tensor.device.index if tensor.is_cuda else -1
        # numpy aliases the CPU pool so ucxx sees a buffer-protocol object (no copy)
        self._np = None if self.is_cuda else self.flat.numpy()

    @property
    def base_ptr(self) -> int:
        return int(self.tensor.data_ptr())

    def check_ids(self, ids: Sequence[int], what: str) -> None:
        bad = [i for i in ids if not 0 <= i < self.layout.num_blocks]
        if bad:
            raise TransferValueError(f"{what}: block ids {bad[:8]} outside [0, "
                                     f"{self.layout.num_blocks})")
        if len(set(ids)) != len(ids):
            raise TransferValueError(f"{what}: duplicate block ids")

    def view(self, start_block: int, num_blocks: int) -> object:
        """Zero-copy byte view of a block run: numpy on CPU, a uint8 tensor on CUDA."""
        a, b = start_block * self.block_nbytes, (start_block + num_blocks) * self.block_nbytes
        return self.flat[a:b] if self._np is None else self._np[a:b]

    def copy_run(self, dst_pool: KVPool, run: BlockRun) -> None:
        """The fake's data plane: a plain device copy between two pools."""
        n = run.num_blocks * self.block_nbytes
        s, d = run.src_start * self.block_nbytes, run.dst_start * dst_pool.block_nbytes
        dst_pool.flat[d:d + n].copy_(self.flat[s:s + n])
