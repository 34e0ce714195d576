"""The prefix cache's index: which KV blocks hold which full prompt blocks, and which of those
no request uses any more (the LRU the pool evicts from), plus what it tells the outside.

A block's life, as the block manager (its only caller) moves it:

    free ──allocate──▶ owned ──register (KV written, tokens known)──▶ owned + cached
      ▲                  │                                               │       ▲
      │                  └─last owner frees─▶ free                       │       │ a hit
      │                                          last owner frees (park) ▼       │ (take)
      └──────────── evict (the pool needs a block, LRU order) ◀──── cached, unowned

Owned blocks are refcounted by the block manager; this module only keys cached blocks by
their chain hash (engine/prefix_hash.py) and orders the unowned ones. A cached block is
never written again until it is evicted: requests write only past their cached prefix.

Outside readers (a worker, so that a router index can follow) get a bounded queue of
sequence-numbered ``BlocksStored`` / ``BlocksRemoved`` events and, after a gap, a
``KVSnapshot`` of everything cached as of one sequence number. Torch-free, so the worker's
gRPC process and the router may import the event types.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass

from engine.prefix_hash import BlockHash

# Hashes the event queue holds before it drops its oldest events (a worker drains it every
# step; this bounds it when nobody does). 32-byte hashes: a few MiB.
MAX_QUEUED_HASHES = 1 << 16


@dataclass(frozen=True)
class BlocksStored:
    """Blocks that became cached: a run of one chain, parent first."""

    seq: int  # 1, 2, 3, ... over all events of this engine; a gap means events were dropped
    block_hashes: tuple[BlockHash, ...]  # in chain order: each is the next one's parent
    parent: BlockHash | None  # the hash before block_hashes[0]; None: it starts the chain


@dataclass(frozen=True)
class BlocksRemoved:
    """Cached blocks the pool evicted (reused for other KV)."""

    seq: int
    block_hashes: tuple[BlockHash, ...]


KVEvent = BlocksStored | BlocksRemoved


@dataclass(frozen=True)
class KVSnapshot:
    """Everything cached, as of event ``seq``: a reader that saw a gap replaces its view with
    this and applies events from seq + 1 on."""

    seq: int
    # (hash, parent) in the order they were cached: a parent comes first unless it was
    # evicted and cached again after its child
    blocks: tuple[tuple[BlockHash, BlockHash | None], ...]


@dataclass(frozen=True)
class PrefixCacheStats:
    """Cumulative counters (Prometheus counters on a worker's /metrics) and two gauges."""

    enabled: bool
    queried_tokens: int  # prompt tokens of admitted requests looked up (each request once)
    hit_tokens: int  # of those, found cached (their prefill was skipped)
    cached_blocks: int  # gauge: blocks holding cached KV, owned or not
    evictable_blocks: int  # gauge: cached blocks no request owns (counted as free)
    evicted_blocks: int  # cached blocks reused for other KV
    kv_events_dropped: int = 0  # events the bounded queue dropped unread (readers resync)


class KVEventQueue:
    """Sequence-numbered events, bounded by the hashes they carry: past the bound the oldest
    go, and the reader learns of the loss from the gap in ``seq``."""

    def __init__(self, max_hashes: int = MAX_QUEUED_HASHES) -> None:
        if max_hashes < 1:
            raise ValueError(f"max_hashes: must be >= 1, got {max_hashes}")
        self.max_hashes = max_hashes
        self.last_seq = 0  # the newest event's seq (0: none yet)
        self.dropped = 0  # events dropped unread, ever
        self._events: deque[KVEvent] = deque()
        self._hashes = 0

    def stored(self, hashes: list[BlockHash], parent: BlockHash | None) -> None:
        self.last_seq += 1
        self._push(BlocksStored(self.last_seq, tuple(hashes), parent))

    def removed(self, hashes: list[BlockHash]) -> None:
        self.last_seq += 1
        self._push(BlocksRemoved(self.last_seq, tuple(hashes)))

    def _push(self, ev: KVEvent) -> None:
        self._events.append(ev)
        self._hashes += len(ev.block_hashes)
        # the newest event stays even alone over the bound: it is at most a pool's worth
        while self._hashes > self.max_hashes and len(self._events) > 1:
            old = self._events.popleft()
            self._hashes -= len(old.block_hashes)
            self.dropped += 1

    def drain(self) -> list[KVEvent]:
        out = list(self._events)
        self._events.clear()
        self._hashes = 0
        return out

    def __len__(self) -> int:
        return len(self._events)


class PrefixCache:
    def __init__(self, max_event_hashes: int = MAX_QUEUED_HASHES) -> None:
        self._block_of: dict[BlockHash, int] = {}
        self._entry: dict[int, tuple[BlockHash, BlockHash | None]] = {}  # block -> (hash, parent)
        # cached blocks no request owns, least recently released first
        self._lru: OrderedDict[int, None] = OrderedDict()
        self.events = KVEventQueue(max_event_hashes)
        self.queried_tokens = 0
        self.hit_tokens = 0
        self.evicted_blocks = 0

    @property
    def num_cached(self) -> int:
        return len(self._entry)

    @property
    def num_evictable(self) -> int:
        return len(self._lru)

    def is_cached(self, block: int) -> bool:
        return block in self._entry

    def hash_of(self, block: int) -> BlockHash | None:
        e = self._entry.get(block)
        return None if e is None else e[0]

    def match(self, hashes: list[BlockHash]) -> list[int]:
        """The blocks holding the longest cached run of ``hashes`` from its start."""
        out = []
        for h in hashes:
            b = self._block_of.get(h)
            if b is None:
                break
            out.append(b)
        return out

    def insert(self, blocks: list[int], hashes: list[BlockHash],
               parent: BlockHash | None) -> int:
        """Caches owned ``blocks`` (KV written) under a run of their chain's ``hashes``; a
        hash already cached in another block keeps that block (this one stays uncached and
        goes back to the pool when freed). Returns how many became cached."""
        stored: list[BlockHash] = []  # the current run of newly cached hashes
        run_parent = parent
        n = 0
        for b, h in zip(blocks, hashes, strict=True):
            known = self._entry.get(b)
            if known is not None:
                assert known[0] == h, f"block {b} is cached under another hash"
            elif h not in self._block_of:
                self._block_of[h] = b
                self._entry[b] = (h, parent)
                if not stored:
                    run_parent = parent
                stored.append(h)
                n += 1
                parent = h
                continue
            if stored:  # the run breaks here: what came before is one event
                self.events.stored(stored, run_parent)
                stored = []
            parent = h
        if stored:
            self.events.stored(stored, run_parent)
        return n

    def park(self, block: int) -> bool:
        """A block's last owner freed it: a cached one waits in the LRU (True), an uncached
        one goes back to the pool (False)."""
        if block not in self._entry:
            return False
        self._lru[block] = None
        return True

    def take(self, block: int) -> None:
        """A cached block gets an owner again (a hit): it leaves the LRU if it was there."""
        self._lru.pop(block, None)

    def evict(self) -> tuple[int, BlockHash]:
        """The least recently released unowned cached block, forgotten; the caller reuses it
        and reports the hash removed."""
        block, _ = self._lru.popitem(last=False)
        h, _parent = self._entry.pop(block)
        del self._block_of[h]
        self.evicted_blocks += 1
        return block, h

    def record_query(self, queried_tokens: int, hit_tokens: int) -> None:
        self.queried_tokens += queried_tokens
        self.hit_tokens += hit_tokens

    def snapshot(self) -> KVSnapshot:
        return KVSnapshot(self.events.last_seq, tuple(self._entry.values()))

    def stats(self) -> PrefixCacheStats:
        return PrefixCacheStats(True, self.queried_tokens, self.hit_tokens, self.num_cached,
                                self.num_evictable, self.evicted_blocks, self.events.dropped)
