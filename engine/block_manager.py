"""Paged-KV block pool: allocate, free, ref-count, an accounting query, and (with prefix
caching) the blocks that keep their KV after their last owner left.

With a ``PrefixCache`` (engine/prefix_cache.py), a freed block whose KV is cached is not
returned to the free list but parked in the cache's LRU: it still counts as free (an
allocation may evict it) until a request with the same prefix takes it back. Allocation
uses never-cached blocks first, so cached KV lives as long as the pool can spare it.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from engine.prefix_cache import PrefixCache, PrefixCacheStats
from engine.prefix_hash import BlockHash


@dataclass(frozen=True)
class BlockAccounting:
    total: int
    free: int  # allocatable now: never-cached free blocks plus evictable cached ones
    used: int  # held by at least one owner; free + used == total always
    cached: int = 0  # of the free ones, those still holding cached KV (evicted on demand)


class NoFreeBlocks(RuntimeError):
    """The pool cannot satisfy an allocation; callers preempt or queue."""


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int,
                 cache: PrefixCache | None = None) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_kv_blocks: must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.cache = cache  # None: prefix caching off, a freed block is simply free
        self._free: deque[int] = deque(range(num_blocks))  # unowned and holding no cached KV
        self._refs = [0] * num_blocks

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    @property
    def num_free(self) -> int:
        return len(self._free) + (self.cache.num_evictable if self.cache else 0)

    def can_allocate(self, n: int) -> bool:
        return n <= self.num_free

    def allocate(self, n: int) -> list[int]:
        if n > self.num_free:
            raise NoFreeBlocks(f"need {n} blocks, {self.num_free} free")
        out = [self._free.popleft() for _ in range(min(n, len(self._free)))]
        if len(out) < n:
            assert self.cache is not None
            evicted: list[BlockHash] = []
            while len(out) < n:
                b, h = self.cache.evict()
                out.append(b)
                evicted.append(h)
            self.cache.events.removed(evicted)
        for b in out:
            self._refs[b] = 1
        return out

    def grow(self, block_ids: list[int], num_tokens: int) -> bool:
        """Extends block_ids in place to hold num_tokens; False (and no change) if it can't."""
        need = self.blocks_for(num_tokens) - len(block_ids)
        if need <= 0:
            return True
        if need > self.num_free:
            return False
        block_ids.extend(self.allocate(need))
        return True

    def share(self, block_ids: list[int]) -> None:
        """Adds an owner to blocks already held (e.g. a transfer pinning them)."""
        for b in block_ids:
            assert self._refs[b] > 0, f"block {b} is free"
            self._refs[b] += 1

    def free(self, block_ids: list[int]) -> None:
        # Last block first: a request's cached blocks then enter the LRU tail first, so the
        # end of a chain is evicted before its head (a head evicted first would strand the
        # rest, unreachable by any lookup, yet still holding pool space).
        for b in reversed(block_ids):
            assert self._refs[b] > 0, f"double free of block {b}"
            self._refs[b] -= 1
            if self._refs[b] == 0 and not (self.cache and self.cache.park(b)):
                self._free.append(b)

    # ---- prefix caching (all no-ops without a cache) ----------------------------------------

    def match(self, hashes: list[BlockHash]) -> list[int]:
        """The cached blocks holding the longest run of ``hashes`` from its start (no
        reference taken: ``fits`` then ``take`` them)."""
        return self.cache.match(hashes) if self.cache else []

    def fits(self, cached: list[int], n_new: int) -> bool:
        """Whether taking the ``cached`` blocks and allocating ``n_new`` more can both
        succeed: taking an unowned cached block removes it from what allocate can evict."""
        reviving = sum(1 for b in cached if self._refs[b] == 0)
        return n_new <= self.num_free - reviving

    def take(self, cached: list[int]) -> None:
        """Adds an owner to cached blocks, owned or parked (a prefix hit)."""
        if not cached:
            return
        assert self.cache is not None
        for b in cached:
            assert self.cache.is_cached(b), f"block {b} is not cached"
            if self._refs[b] == 0:
                self.cache.take(b)
            self._refs[b] += 1

    def register(self, block_ids: list[int], hashes: list[BlockHash],
                 parent: BlockHash | None) -> None:
        """Caches owned blocks whose KV is fully written, under their chain hashes (a run
        following ``parent``)."""
        if self.cache is None:
            return
        for b in block_ids:
            assert self._refs[b] > 0, f"block {b} is free"
        self.cache.insert(block_ids, hashes, parent)

    def refcount(self, block: int) -> int:
        return self._refs[block]

    def cache_stats(self) -> PrefixCacheStats:
        if self.cache is None:
            return PrefixCacheStats(False, 0, 0, 0, 0, 0)
        return self.cache.stats()

    def accounting(self) -> BlockAccounting:
        free = self.num_free
        return BlockAccounting(total=self.num_blocks, free=free, used=self.num_blocks - free,
                               cached=self.cache.num_evictable if self.cache else 0)
