"""One request's prompt as the KV index sees it: how many of its leading tokens a worker
reported holding in its prefix cache.

The chain hashes (engine/prefix_hash.py, torch-free) depend on the worker's model key (its
kv_fingerprint), block size and the request's cache salt, so they are computed per
(fingerprint, block size), lazily and only as far as some worker's view matches: a long
prompt nobody holds costs one hash, not one per block.
"""

from __future__ import annotations

from collections.abc import Sequence

from engine.prefix_hash import block_hash, chain_root
from router.control.kv_index import KVIndex
from router.control.registry import WorkerInfo


class PrefixLookup:
    def __init__(self, index: KVIndex, token_ids: Sequence[int], cache_salt: str = "") -> None:
        self.index = index
        self.token_ids = token_ids
        self.cache_salt = cache_salt
        self._chains: dict[tuple[str, int], list[bytes]] = {}
        self._memo: dict[int, int] = {}  # id(worker) -> cached tokens

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    def cached_tokens(self, w: WorkerInfo) -> int:
        """Leading prompt tokens ``w`` reported holding (whole blocks; 0: none, or the
        worker caches nothing, or cannot keep this request's salt apart)."""
        if (memo := self._memo.get(id(w))) is not None:
            return memo
        n = 0
        if w.block_size > 0 and w.prefix_caching and (w.accepts_cache_salt
                                                      or not self.cache_salt):
            n = self._match(w) * w.block_size
        self._memo[id(w)] = n
        return n

    def _match(self, w: WorkerInfo) -> int:
        key = (w.kv_fingerprint, w.block_size)
        chain = self._chains.setdefault(key, [])
        bs, toks = w.block_size, self.token_ids
        n = 0
        while (n + 1) * bs <= len(toks):
            if n == len(chain):
                parent = chain[-1] if chain else chain_root(w.kv_fingerprint, "",
                                                            self.cache_salt)
                chain.append(block_hash(parent, toks[n * bs:(n + 1) * bs]))
            if self.index.cached_blocks(w, chain[n:n + 1]) == 0:
                break
            n += 1
        return n
