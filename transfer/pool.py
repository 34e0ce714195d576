"""A worker's KV pool as byte regions: block runs and zero-copy views into the pool tensor."""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch

from engine.kv_layout import KVLayout
from transfer.head_cut import HeadCut, Rows

_TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
                 "float8_e4m3fn": torch.float8_e4m3fn}


class TransferValueError(ValueError):
    """Bad block ids or pool given by the caller."""


class BlockRun(NamedTuple):  # a tuple: thousands are made per prompt, on the engine thread
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
    if not src:
        return runs
    # plain ints in the loop, one BlockRun per run: a prompt has thousands of blocks and
    # this runs on the engine's thread
    s0, d0, n = int(src[0]), int(dst[0]), 1
    for s, d in zip(src[1:], dst[1:], strict=True):
        if s == s0 + n and d == d0 + n:
            n += 1
        else:
            runs.append(BlockRun(s0, d0, n))
            s0, d0, n = int(s), int(d), 1
    runs.append(BlockRun(s0, d0, n))
    return runs


def strided(flat: torch.Tensor, r: Rows) -> torch.Tensor:
    """A zero-copy [rows, width] view of a pitched region of a flat byte pool."""
    if r.offset < 0 or r.rows < 1 or r.end > flat.numel():
        raise TransferValueError(f"region {tuple(r)} outside a pool of {flat.numel()} bytes")
    return flat[r.offset:].as_strided((r.rows, r.width), (r.pitch, 1))


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
    def storage_offset_bytes(self) -> int:
        return int(self.tensor.data_ptr() - self.tensor.untyped_storage().data_ptr())

    def share_memory(self) -> tuple[int, int]:
        """Moves a CPU pool into shared memory in place (the engine's views follow);
        returns (fd, size) of the shared file, for same-host peers to map."""
        storage = self.tensor.untyped_storage()
        storage.share_memory_()
        self._np = self.flat.numpy()  # the old numpy alias points at the freed memory
        fd, size = storage._share_fd_cpu_()
        return int(fd), int(size)

    @property
    def base_ptr(self) -> int:
        return int(self.tensor.data_ptr())

    def check_ids(self, ids: Sequence[int], what: str) -> None:
        if ids and 0 <= min(ids) and max(ids) < self.layout.num_blocks:
            bad = []  # the common case, without a Python loop over every id
        else:
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

    def copy_run(self, dst_pool: KVPool, run: BlockRun, cut: HeadCut | None = None) -> None:
        """The fake's data plane: a plain device copy between two pools (with a cut: one
        strided copy of the part's heads)."""
        if cut is not None:
            strided(dst_pool.flat, cut.dst_rows(run.dst_start, run.num_blocks)).copy_(
                strided(self.flat, cut.src_rows(run.src_start, run.num_blocks)))
            return
        n = run.num_blocks * self.block_nbytes
        s, d = run.src_start * self.block_nbytes, run.dst_start * dst_pool.block_nbytes
        dst_pool.flat[d:d + n].copy_(self.flat[s:s + n])
