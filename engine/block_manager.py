"""Paged-KV block pool: allocate, free, ref-count, and an accounting query."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass


@dataclass(frozen=True)
class BlockAccounting:
    total: int
    free: int
    used: int  # held by at least one owner; free + used == total always


class NoFreeBlocks(RuntimeError):
    """The pool cannot satisfy an allocation; callers preempt or queue."""


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_kv_blocks: must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: deque[int] = deque(range(num_blocks))
        self._refs = [0] * num_blocks

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    @property
    def num_free(self) -> int:
        return len(self._free)

    def can_allocate(self, n: int) -> bool:
        return n <= len(self._free)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise NoFreeBlocks(f"need {n} blocks, {len(self._free)} free")
        out = [self._free.popleft() for _ in range(n)]
        for b in out:
            self._refs[b] = 1
        return out

    def grow(self, block_ids: list[int], num_tokens: int) -> bool:
        """Extends block_ids in place to hold num_tokens; False (and no change) if it can't."""
        need = self.blocks_for(num_tokens) - len(block_ids)
        if need <= 0:
            return True
        if need > len(self._free):
            return False
        block_ids.extend(self.allocate(need))
        return True

    def share(self, block_ids: list[int]) -> None:
        """Adds an owner to blocks already held (e.g. a transfer pinning them)."""
        for b in block_ids:
            assert self._refs[b] > 0, f"block {b} is free"
            self._refs[b] += 1

    def free(self, block_ids: list[int]) -> None:
        for b in block_ids:
            assert self._refs[b] > 0, f"double free of block {b}"
            self._refs[b] -= 1
            if self._refs[b] == 0:
                self._free.append(b)

    def accounting(self) -> BlockAccounting:
        free = len(self._free)
        return BlockAccounting(total=self.num_blocks, free=free, used=self.num_blocks - free)
