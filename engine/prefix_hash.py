"""The prompt-block hash chain: the name of a full KV block's content on every host.

A block's hash is ``blake2b(parent hash || its token ids)``; the first block's parent is the
chain's *root*, a digest of (model key, adapter, cache salt). Equal hashes therefore mean the
same tokens at the same positions after the same prefix, under the same weights and salt,
so the KV is the same numbers wherever it was computed. Only full blocks are hashed: a
partial block's content is still growing.

Deterministic across processes and hosts: no Python ``hash()`` (salted per process), token
ids packed as little-endian uint32 (any id below 2**32; the engine checks ids against the
vocabulary first), strings as length-prefixed UTF-8 so no two keys share an encoding.

The model key is the engine's KV layout fingerprint (``KVLayout.fingerprint()``: weights,
dtype, block size, layers, heads). Every worker reports it at registration, so the router
(which must not import torch, and this module imports none) can compute the same chain as
the engine from a request's token ids, block size and ``cache_salt``.
"""

from __future__ import annotations

import functools
import hashlib
import struct
from collections.abc import Sequence

HASH_BYTES = 32  # the engine trusts a hit without comparing tokens: collisions must not be
# findable, not merely unlikely (a per-request salt exists to keep tenants apart)
_ROOT_TAG = b"pdserve.prefix.v1"  # a new chain format must never match the old one

BlockHash = bytes


def _field(s: str) -> bytes:
    b = s.encode("utf-8")
    return struct.pack("<I", len(b)) + b


def chain_root(model_key: str, adapter: str = "", cache_salt: str | None = None) -> BlockHash:
    """The parent of a chain's first block: everything besides tokens that decides the KV.
    ``adapter`` is "" for the base weights; ``cache_salt`` None and "" are the same (none)."""
    h = hashlib.blake2b(digest_size=HASH_BYTES)
    h.update(_ROOT_TAG)
    for s in (model_key, adapter, cache_salt or ""):
        h.update(_field(s))
    return h.digest()


@functools.lru_cache(maxsize=16)
def _packer(n: int) -> struct.Struct:
    # one per block size: parsing the format for every block doubled the cost of a hash
    return struct.Struct(f"<{n}I")


def block_hash(parent: BlockHash, token_ids: Sequence[int]) -> BlockHash:
    """One block's hash from its parent's (or the root) and its token ids."""
    data = parent + _packer(len(token_ids)).pack(*token_ids)
    return hashlib.blake2b(data, digest_size=HASH_BYTES).digest()


def block_hashes(token_ids: Sequence[int], block_size: int, root: BlockHash) -> list[BlockHash]:
    """The hashes of every full block of ``token_ids`` (a trailing partial block has none)."""
    if block_size < 1:
        raise ValueError(f"block_size: must be >= 1, got {block_size}")
    out: list[BlockHash] = []
    parent = root
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = block_hash(parent, token_ids[start:start + block_size])
        out.append(parent)
    return out
