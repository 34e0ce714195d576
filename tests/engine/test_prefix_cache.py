"""The prefix cache without a model: the hash chain, the block manager's cached blocks (refs,
LRU eviction, duplicates) and the event queue a router index follows."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from engine.block_manager import BlockManager
from engine.prefix_cache import BlocksRemoved, BlocksStored, KVEventQueue, PrefixCache
from engine.prefix_hash import HASH_BYTES, block_hash, block_hashes, chain_root

ROOT = chain_root("fp-1234")
TOKENS = list(range(100, 118))  # 18 tokens: 4 full blocks of 4 and a partial one

_CHILD = (
    "from engine.prefix_hash import block_hashes, chain_root\n"
    "r = chain_root('fp-1234', 'lora-a', 'tenant-7')\n"
    "print(','.join(h.hex() for h in block_hashes(list(range(100, 118)), 4, r)))\n"
)


def test_hashes_are_the_same_in_every_process():
    """No per-process state (Python's hash() is salted per process): two interpreters with
    different hash seeds agree with this one."""
    here = ",".join(h.hex() for h in
                    block_hashes(TOKENS, 4, chain_root("fp-1234", "lora-a", "tenant-7")))
    for seed in ("1", "2"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        out = subprocess.run([sys.executable, "-c", _CHILD], env=env, check=True,
                             capture_output=True, text=True).stdout.strip()
        assert out == here
    # and across releases: a changed encoding would silently empty every router's index
    assert chain_root("m").hex()[:16] == "6ed913b6c4135522"
    assert block_hash(chain_root("m"), [1, 2, 3, 4]).hex()[:16] == "21908335ebc4f660"


def test_chain_is_keyed_by_model_adapter_salt_and_prefix():
    hs = block_hashes(TOKENS, 4, ROOT)
    assert len(hs) == 4 and all(len(h) == HASH_BYTES for h in hs)  # the partial block: none
    assert block_hashes(TOKENS[:16], 4, ROOT) == hs  # exact multiple: every block
    assert block_hashes(TOKENS[:3], 4, ROOT) == []
    assert block_hashes(TOKENS, 4, chain_root("fp-1234")) == hs  # None salt == no salt
    assert block_hashes(TOKENS, 4, chain_root("fp-1234", cache_salt="")) == hs
    for other in (chain_root("fp-9999"), chain_root("fp-1234", "lora-a"),
                  chain_root("fp-1234", cache_salt="t")):
        assert not set(block_hashes(TOKENS, 4, other)) & set(hs)
    # a block's hash depends on everything before it, not just its own tokens
    shifted = block_hashes([7, 7, 7, 7, *TOKENS[4:8]], 4, ROOT)
    assert shifted[1] != hs[1]
    # length-prefixed fields: ("ab", "c") and ("a", "bc") are different keys
    assert chain_root("ab", "c") != chain_root("a", "bc")
    with pytest.raises(ValueError, match="block_size"):
        block_hashes(TOKENS, 0, ROOT)


def _cached_pool(n: int = 8) -> BlockManager:
    return BlockManager(n, block_size=4, cache=PrefixCache())


def test_freed_cached_blocks_stay_until_the_pool_needs_them():
    bm = _cached_pool()
    hs = block_hashes(TOKENS, 4, ROOT)
    a = bm.allocate(5)  # 4 full blocks and the partial one
    bm.register(a[:4], hs, None)
    bm.free(a)
    acc = bm.accounting()
    assert (acc.free, acc.used, acc.cached) == (8, 0, 4)  # cached blocks count as free
    assert bm.match(hs) == a[:4]
    # a different first block changes every hash after it: nothing matches
    assert bm.match(block_hashes([9] * 4 + TOKENS[4:], 4, ROOT)) == []
    # A hit takes the blocks back (out of the LRU), so allocate cannot evict them.
    hit = bm.match(hs[:2])
    assert bm.fits(hit, 6) and not bm.fits(hit, 7)
    bm.take(hit)
    assert bm.accounting().used == 2
    new = bm.allocate(6)
    assert not set(new) & set(hit)
    assert bm.cache is not None and bm.cache.evicted_blocks == 2  # 4 never-cached went first
    bm.free(new)
    bm.free(hit)
    assert all(bm.refcount(b) == 0 for b in range(8)) and bm.accounting().free == 8


def test_lru_evicts_least_recently_released_and_a_chain_tail_first():
    bm = _cached_pool(6)
    chains = {k: block_hashes([k] * 8, 4, ROOT) for k in (1, 2, 3)}
    blocks = {}
    for k in (1, 2, 3):
        b = bm.allocate(2)
        bm.register(b, chains[k], None)
        blocks[k] = b
    bm.free(blocks[2])
    bm.free(blocks[1])
    bm.free(blocks[3])
    # release order 2, 1, 3; within a request the tail block goes first
    order = [blocks[2][1], blocks[2][0], blocks[1][1], blocks[1][0], blocks[3][1], blocks[3][0]]
    assert bm.cache is not None
    evicted = [bm.allocate(1)[0] for _ in range(6)]
    assert evicted == order
    # each eviction was one BlocksRemoved event, after the three BlocksStored
    evs = bm.cache.events.drain()
    assert [type(e) for e in evs] == [BlocksStored] * 3 + [BlocksRemoved] * 6
    assert [e.seq for e in evs] == list(range(1, 10))
    assert [e.block_hashes[0] for e in evs[3:]] == [chains[2][1], chains[2][0], chains[1][1],
                                                     chains[1][0], chains[3][1], chains[3][0]]


def test_hit_refreshes_recency():
    bm = _cached_pool(2)
    h1, h2 = block_hashes([1] * 4, 4, ROOT), block_hashes([2] * 4, 4, ROOT)
    (b1,), (b2,) = bm.allocate(1), bm.allocate(1)
    bm.register([b1], h1, None)
    bm.register([b2], h2, None)
    bm.free([b1])
    bm.free([b2])
    bm.take(bm.match(h1))  # b1 used again: now b2 is the least recently released
    bm.free([b1])
    assert bm.allocate(1) == [b2] and bm.match(h1) == [b1] and bm.match(h2) == []


def test_duplicate_content_keeps_the_first_block_and_frees_the_second():
    bm = _cached_pool(4)
    hs = block_hashes(TOKENS[:8], 4, ROOT)
    a, b = bm.allocate(2), bm.allocate(2)
    bm.register(a, hs, None)
    bm.register(b, hs, None)  # computed concurrently: same content, already cached
    bm.register(a, hs, None)  # registering again is a no-op
    assert bm.cache is not None and bm.cache.num_cached == 2
    bm.free(b)
    assert bm.accounting().cached == 0 and bm.num_free == 2  # b's went back uncached
    bm.free(a)
    assert bm.accounting().cached == 2 and bm.match(hs) == a
    evs = bm.cache.events.drain()
    assert len(evs) == 1 and isinstance(evs[0], BlocksStored)
    assert evs[0].block_hashes == tuple(hs) and evs[0].parent is None


def test_stored_events_carry_their_parent_and_split_at_known_blocks():
    bm = _cached_pool(8)
    hs = block_hashes(TOKENS, 4, ROOT)
    (a0,), (a2,) = bm.allocate(1), bm.allocate(1)
    bm.register([a0], hs[:1], None)
    bm.register([a2], hs[2:3], hs[1])  # its parent is not cached (evicted, say)
    b = bm.allocate(4)
    bm.register(b, hs, None)  # new, known, new around the cached ones: two runs
    assert bm.cache is not None
    evs = bm.cache.events.drain()
    assert [(e.seq, e.block_hashes, e.parent) for e in evs if isinstance(e, BlocksStored)] == [
        (1, (hs[0],), None), (2, (hs[2],), hs[1]), (3, (hs[1],), hs[0]), (4, (hs[3],), hs[2])]
    snap = bm.cache.snapshot()
    assert snap.seq == 4
    assert snap.blocks == ((hs[0], None), (hs[2], hs[1]), (hs[1], hs[0]), (hs[3], hs[2]))
    assert bm.match(hs) == [a0, b[1], a2, b[3]]
    bm.free([a0, a2])
    bm.free(b)
    assert bm.accounting().free == 8


def test_event_queue_is_bounded_and_the_gap_shows():
    q = KVEventQueue(max_hashes=4)
    for i in range(5):
        q.stored([bytes([i]) * 32] * 2, None)
    evs = q.drain()
    assert [e.seq for e in evs] == [4, 5] and q.dropped == 3  # seq 1-3 dropped: resync
    cache = PrefixCache(max_event_hashes=1)
    cache.events.stored([b"a" * 32], None)
    cache.events.stored([b"b" * 32], None)
    assert cache.stats().kv_events_dropped == 1
    q.removed([b"x" * 32] * 9)  # one event over the bound alone is kept whole
    assert len(q) == 1 and q.last_seq == 6
    with pytest.raises(ValueError, match="max_hashes"):
        KVEventQueue(0)


def test_without_a_cache_nothing_is_kept():
    bm = BlockManager(4, block_size=4)
    a = bm.allocate(2)
    bm.register(a, block_hashes(TOKENS[:8], 4, ROOT), None)
    assert bm.match(block_hashes(TOKENS[:8], 4, ROOT)) == []
    bm.free(a)
    assert bm.accounting().cached == 0 and not bm.cache_stats().enabled
