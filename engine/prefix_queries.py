"""What the engine answers about its prefix cache: a worker's reports (counters, the KV
events a router index follows, a snapshot to resync from) and a P/D consumer's question
"which leading blocks of this prompt do I hold".

A mixin of ``LLMEngine`` (its ``blocks``, ``config`` and ``prefix_model_key``), so the roles
keep calling the engine and never its internals.

Reservation reuse (``add_remote(..., reuse_cached=True)``): the consumer's reservation takes
the cached blocks holding the prompt's leading full blocks (all but the one holding the last
token, which always moves), and the step result's
``reserved_cached`` says how many. They may be shared with running requests, so the sender
must write none of them, only the blocks after (KVDestination.cached_blocks); a sender
that writes every block must not ask for reuse. Landed KV is cached either way, once the
transfer is done.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from engine.prefix_cache import KVEvent, KVSnapshot, PrefixCacheStats
from engine.prefix_hash import block_hashes, chain_root

if TYPE_CHECKING:
    from engine.block_manager import BlockManager
    from engine.config import EngineConfig


class PrefixCacheQueries:
    blocks: BlockManager
    config: EngineConfig
    prefix_model_key: str  # the chains' model key: the KV layout fingerprint

    def chain_root(self, cache_salt: str | None = None) -> bytes | None:
        """The root of this engine's block hash chains for a salt; None with caching off."""
        if self.blocks.cache is None:
            return None
        return chain_root(self.prefix_model_key, "", cache_salt)

    def prefix_cache_stats(self) -> PrefixCacheStats:
        """Prompt tokens looked up and hit (cumulative), cached and evictable blocks."""
        return self.blocks.cache_stats()

    def drain_kv_events(self) -> list[KVEvent]:
        """The blocks cached and evicted since the last drain, in order (a worker forwards
        them each step so a router index can follow). Their ``seq`` runs 1, 2, 3, ...; a
        gap means the bounded queue dropped events nobody drained: resync from
        kv_cache_snapshot(). Empty with caching off."""
        return self.blocks.cache.events.drain() if self.blocks.cache else []

    def kv_cache_snapshot(self) -> KVSnapshot:
        """Every cached block's (hash, parent) as of event ``seq``: a reader's view after a
        gap (apply the events after seq on top of it)."""
        if self.blocks.cache is None:
            return KVSnapshot(0, ())
        return self.blocks.cache.snapshot()

    def cached_prefix_blocks(self, token_ids: list[int], cache_salt: str | None = None) -> int:
        """How many leading full blocks of token_ids this engine holds cached now (a
        consumer's answer to "what need not be sent"; a hint: they may be evicted before
        a reservation takes them, which add_remote(reuse_cached=True) reports exactly)."""
        root = self.chain_root(cache_salt)
        if root is None:
            return 0
        return len(self.blocks.match(block_hashes(token_ids, self.config.block_size, root)))
