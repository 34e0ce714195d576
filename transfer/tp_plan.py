"""Which producer rank sends which KV heads to which consumer rank, for any two TP sizes.

Pure arithmetic, no torch: the worker that wires TP transfers, the sender and the receiver
all compute the same plan from (producer tp, consumer tp, total KV heads), so nothing of
it travels on the wire and a peer cannot talk a receiver into taking other heads.

Every consumer rank receives exactly its heads, each head from ONE producer rank. A head
replicated on several producer ranks (fewer KV heads than producer ranks) is taken from
the replica ``c % replicas`` for consumer rank c, so consumer ranks that need the same
head spread over its replicas instead of all reading one; a head replicated on several
consumer ranks is sent once to each of them (each keeps its own copy).

A replicated latent (an MLA pool, ``KVLayout.kind`` "mla": the same bytes on every rank of
either worker) is the exception: it moves once per request, from ONE producer rank to
consumer rank 0 (of the attention group holding the request), which copies it to its other
ranks itself (``engine.parallel.block_copy``). Which producer rank sends is a pure function
of the request id (``latent_source``), so requests spread over the producer's ranks and
the consumer knows, without being told, which producer rank may write a request's blocks.
"""

from __future__ import annotations

import functools
import hashlib
from typing import NamedTuple

from engine.kv_layout import KVLayout, check_tp, head_range


class Part(NamedTuple):
    """One producer rank's share of one consumer rank's heads: a contiguous head range."""

    src_rank: int
    dst_rank: int
    head: int  # first head, in the model's numbering
    num_heads: int  # heads in the part
    src_first: int  # where ``head`` sits among the producer rank's local heads
    dst_first: int  # and among the consumer rank's local heads


def is_latent(layout: KVLayout) -> bool:
    """Whether the layout's KV is one latent replicated on every rank (moved once)."""
    return layout.kind == "mla"


def latent_source(request_id: str, src_tp: int) -> int:
    """The producer rank that sends request ``request_id``'s latent. A digest, not
    hash(): every process (producer and consumer ranks) computes the same rank; and not
    crc32, whose low bits barely change between ids that differ in a last digit."""
    check_tp(1, src_tp, "producer tp_size")
    digest = hashlib.blake2b(request_id.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") % src_tp


@functools.lru_cache(maxsize=256)
def plan(src_tp: int, dst_tp: int, num_kv_heads: int, latent: bool = False,
         source: int = 0) -> tuple[Part, ...]:
    """Every part, ordered by consumer rank then head. latent: a replicated latent, one
    part from producer rank ``source`` to consumer rank 0 (module docstring)."""
    check_tp(num_kv_heads, src_tp, "producer tp_size")
    check_tp(num_kv_heads, dst_tp, "consumer tp_size")
    if latent:
        if num_kv_heads != 1:
            raise ValueError(f"num_kv_heads: a latent is one head, got {num_kv_heads}")
        if not 0 <= source < src_tp:
            raise ValueError(f"source: producer rank {source} outside [0, {src_tp})")
        return (Part(source, 0, 0, 1, 0, 0),)
    src = [head_range(num_kv_heads, src_tp, p) for p in range(src_tp)]
    parts: list[Part] = []
    for c in range(dst_tp):
        c_start, c_count = head_range(num_kv_heads, dst_tp, c)
        for h in range(c_start, c_start + c_count):
            holders = [p for p, (s, n) in enumerate(src) if s <= h < s + n]
            p = holders[c % len(holders)]
            last = parts[-1] if parts else None
            if last is not None and last.dst_rank == c and last.src_rank == p \
                    and last.head + last.num_heads == h:
                parts[-1] = last._replace(num_heads=last.num_heads + 1)
            else:
                parts.append(Part(p, c, h, 1, h - src[p][0], h - c_start))
    return tuple(parts)


def parts_to(dst_rank: int, src_tp: int, dst_tp: int, num_kv_heads: int,
             latent: bool = False, source: int = 0) -> tuple[Part, ...]:
    """What consumer rank ``dst_rank`` receives: one part per producer rank it pulls from."""
    return tuple(p for p in plan(src_tp, dst_tp, num_kv_heads, latent, source)
                 if p.dst_rank == dst_rank)


def parts_from(src_rank: int, src_tp: int, dst_tp: int, num_kv_heads: int,
               latent: bool = False, source: int = 0) -> tuple[Part, ...]:
    """What producer rank ``src_rank`` sends: one part per consumer rank it serves."""
    return tuple(p for p in plan(src_tp, dst_tp, num_kv_heads, latent, source)
                 if p.src_rank == src_rank)


def part_between(src_rank: int, dst_rank: int, src_tp: int, dst_tp: int,
                 num_kv_heads: int, latent: bool = False) -> Part | None:
    """The one part producer rank ``src_rank`` sends consumer rank ``dst_rank``, or None.
    A latent: whichever producer rank a request names may send it to consumer rank 0, so a
    connection between them is the latent's whole part (each request checks its source)."""
    if latent:
        return plan(src_tp, dst_tp, num_kv_heads, True, src_rank)[0] if dst_rank == 0 \
            else None
    found = [p for p in parts_to(dst_rank, src_tp, dst_tp, num_kv_heads) if p.src_rank == src_rank]
    assert len(found) <= 1, found  # heads of both ranks are contiguous: one range at most
    return found[0] if found else None
