"""Routing policies: which worker of a pool takes the next request.

Placement scheme (``place``). A request runs in a *slot*: a (producer, consumer) pair or
one colocated worker. The first pick is over the *entry pool*: every usable colocated
worker plus every usable producer (producers only while some consumer is usable). A
colocated worker therefore competes with each producer as one more way into the cluster,
so ``round_robin`` on 2 producers + 1 colocated sends a third of requests aggregated, and
the load-aware policies send work wherever the queue is shorter. When the entry pick is a
producer, a second pick over the consumer pool completes the pair. Pairs are not fixed:
any producer can push to any consumer (they share a KV fingerprint, checked at register).

A policy only ever sees one non-empty pool at a time (``choose``), which keeps the base
class narrow; the pool name lets stateful policies keep per-pool state. The request's prompt
comes along as a ``PrefixLookup`` (router/control/prefix_lookup.py) for the policy that
places by what workers hold in their prefix caches (``cache_aware``).

Conditional disaggregation (``LocalPrefill``): once a pair is chosen, the consumer prefills
the prompt itself (it runs as that consumer's colocated request: no producer, no transfer)
when the part of the prompt it lacks is short, or when every producer has a queue and the
consumer has room. Each decision is counted by reason.
"""

from __future__ import annotations

import itertools
import random
from abc import ABC, abstractmethod
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field

from router.control.prefix_lookup import PrefixLookup
from router.control.registry import COLOCATED, CONSUMER, PRODUCER, Registry, WorkerInfo

ENTRY_POOL = "entry"
CONSUMER_POOL = "consumer"
# How many queued requests a completely full KV pool is worth. A worker near the end of its
# KV pool will queue (consumer) or preempt (producer) the next request, so KV use must
# weigh about as much as a few waiting requests, but a short queue still beats a full pool.
KV_WEIGHT = 4.0


def load_score(w: WorkerInfo) -> float:
    """Lower is less loaded: queue depth plus weighted KV use.

    Queue depth takes the larger of the worker's last report and the router's own count of
    requests in flight there, since reports arrive once per heartbeat and a burst of
    requests in between would otherwise all look at the same stale numbers.
    """
    load = w.load
    depth = max(load.waiting + load.running, w.inflight) + load.transfers_in_flight
    kv_use = 0.0
    if load.kv_blocks_total:
        kv_use = 1.0 - min(load.kv_blocks_free, load.kv_blocks_total) / load.kv_blocks_total
    return depth + KV_WEIGHT * kv_use


class Policy(ABC):
    name: str = ""

    @abstractmethod
    def choose(self, pool: str, candidates: Sequence[WorkerInfo],
               lookup: PrefixLookup | None = None) -> WorkerInfo:
        """One of ``candidates`` (non-empty, sorted by worker id) for the next request
        (whose prompt ``lookup`` holds, when the caller has one)."""


class RoundRobin(Policy):
    name = "round_robin"

    def __init__(self) -> None:
        self._counters: dict[str, itertools.count[int]] = {}

    def choose(self, pool: str, candidates: Sequence[WorkerInfo],
               lookup: PrefixLookup | None = None) -> WorkerInfo:
        n = next(self._counters.setdefault(pool, itertools.count()))
        return candidates[n % len(candidates)]


class LeastLoaded(Policy):
    name = "least_loaded"

    def choose(self, pool: str, candidates: Sequence[WorkerInfo],
               lookup: PrefixLookup | None = None) -> WorkerInfo:
        # Ties (e.g. an idle cluster) go to the worker given the fewest requests so far, so
        # equal workers share the work instead of the first one taking it all.
        return min(candidates, key=lambda w: (load_score(w), w.dispatched, w.worker_id))


class PowerOfTwo(Policy):
    """Two distinct random candidates, the less loaded wins: near least-loaded balance
    without every router herding onto the same worker between heartbeats."""

    name = "power_of_two"

    def __init__(self, rng: random.Random | None = None) -> None:
        self._rng = rng or random.Random()

    def choose(self, pool: str, candidates: Sequence[WorkerInfo],
               lookup: PrefixLookup | None = None) -> WorkerInfo:
        if len(candidates) == 1:
            return candidates[0]
        a, b = self._rng.sample(list(candidates), 2)
        return b if load_score(b) < load_score(a) else a


# cache_aware's knobs (router/config.py flags of the same names)
CACHE_LOAD_TOKENS = 512  # --cache-load-tokens: prefill tokens one unit of load_score is worth
CACHE_IMBALANCE = 8.0  # --cache-imbalance: load_score gap past which the least loaded wins


class CacheAware(Policy):
    """The worker that minimises ``uncached + load_tokens * load_score``: the prompt tokens
    it would have to compute (a producer, a colocated worker) or receive (a consumer),
    beyond the leading blocks its prefix cache holds by the router's index, plus its load
    priced in tokens. Imbalance guard: when that worker's load_score exceeds the least
    loaded one's by more than ``imbalance``, the least loaded takes the request, so a hot
    prefix cannot pile every request onto one worker. Without a prompt (retries), or with
    an empty index, this is least_loaded."""

    name = "cache_aware"

    def __init__(self, load_tokens: float = CACHE_LOAD_TOKENS,
                 imbalance: float = CACHE_IMBALANCE) -> None:
        self.load_tokens = load_tokens
        self.imbalance = imbalance
        self.by_cache = 0  # picks that differ from the least loaded worker
        self.guarded = 0  # picks the imbalance guard sent to the least loaded instead

    def choose(self, pool: str, candidates: Sequence[WorkerInfo],
               lookup: PrefixLookup | None = None) -> WorkerInfo:
        least = min(candidates, key=lambda w: (load_score(w), w.dispatched, w.worker_id))
        if lookup is None or len(candidates) == 1:
            return least
        n = lookup.num_tokens

        def cost(w: WorkerInfo) -> tuple[float, float, int, str]:
            load = load_score(w)
            return (n - lookup.cached_tokens(w) + self.load_tokens * load, load, w.dispatched,
                    w.worker_id)

        best = min(candidates, key=cost)
        if best is least:
            return best
        if load_score(best) - load_score(least) > self.imbalance:
            self.guarded += 1
            return least
        self.by_cache += 1
        return best


POLICIES: dict[str, type[Policy]] = {p.name: p for p in (RoundRobin, LeastLoaded, PowerOfTwo,
                                                         CacheAware)}


def make_policy(name: str, load_tokens: float = CACHE_LOAD_TOKENS,
                imbalance: float = CACHE_IMBALANCE) -> Policy:
    if name not in POLICIES:
        raise ValueError(f"--policy: must be one of {', '.join(POLICIES)}, got {name!r}")
    if name == CacheAware.name:
        return CacheAware(load_tokens, imbalance)
    return POLICIES[name]()


@dataclass
class LocalPrefill:
    """When a chosen pair's consumer prefills the prompt itself (router/config.py:
    --local-prefill-max-tokens, -1: never)."""

    max_tokens: int  # the consumer lacks at most this many prompt tokens: it prefills them
    decisions: dict[str, int] = field(default_factory=lambda: {
        "short_tail": 0, "producers_saturated": 0, "remote": 0})

    def reason(self, lookup: PrefixLookup, consumer: WorkerInfo,
               producers: Sequence[WorkerInfo]) -> str:
        """Why ``consumer`` prefills locally ("" : it does not; the pair runs P/D)."""
        if self.max_tokens < 0:
            return ""
        held = lookup.cached_tokens(consumer)
        # Only short prefills move, whatever the reason. A long one on the consumer runs
        # beside its decode batch and stalls every request in it: on one H200 saturated
        # producers sent the seeds' 1024-token prompts there and took the consumer's TPOT
        # p50 from 13 ms to 69-158 ms (bench/RESULTS.md, launch pacing), the interference
        # P/D exists to end.
        if lookup.num_tokens - held > self.max_tokens:
            return ""
        if held:
            return "short_tail"
        load = consumer.load
        room = (load.kv_blocks_total and consumer.block_size
                and load.kv_blocks_free * consumer.block_size >= lookup.num_tokens
                and load.waiting == 0)
        if room and producers and all(p.load.waiting > 0 for p in producers):
            return "producers_saturated"
        return ""

    def count(self, reason: str) -> None:
        self.decisions[reason or "remote"] += 1


@dataclass(frozen=True)
class Slot:
    """Where one request runs: ``colocated`` alone, or ``producer`` with ``consumer``."""

    producer: WorkerInfo | None = None
    consumer: WorkerInfo | None = None
    colocated: WorkerInfo | None = None

    @property
    def workers(self) -> list[WorkerInfo]:
        return [w for w in (self.producer, self.consumer, self.colocated) if w is not None]

    @property
    def reuses_cache(self) -> bool:
        """The consumer may reserve its cached leading blocks and the producer skips them
        (KVDestination.cached_blocks): both report a block size, i.e. speak that protocol."""
        return bool(self.producer and self.consumer and self.producer.block_size
                    and self.consumer.block_size)


def place(registry: Registry, policy: Policy,
          exclude: Collection[WorkerInfo] = (), *, busy_ok: bool = False,
          lookup: PrefixLookup | None = None,
          local: LocalPrefill | None = None) -> Slot | None:
    """A slot for the next request, or None when the cluster cannot serve one.

    exclude: registrations (any role) a retried or migrated request already failed on; a
    worker that registered again since (a restart) is a new one and may be picked.
    busy_ok: busy workers (behind, ``Registry.placeable``) may be picked too; new requests
    never go to them, but a running request that lost its worker is better off there than
    failed.
    lookup: the request's prompt, for cache_aware; local: conditional local prefill (the
    chosen consumer runs the request alone, as a colocated slot).
    """
    gone = {id(w) for w in exclude}
    pool = registry.usable if busy_ok else registry.placeable

    salted = lookup is not None and bool(lookup.cache_salt)

    def usable(role: int) -> list[WorkerInfo]:
        # a salted request never goes where the salt would be ignored (shared blocks)
        return [w for w in pool(role) if id(w) not in gone
                and (w.accepts_cache_salt or not salted)]

    consumers = _sorted(usable(CONSUMER))
    entry = usable(COLOCATED)
    if consumers:
        entry += usable(PRODUCER)
    if not entry:
        return None
    first = policy.choose(ENTRY_POOL, _sorted(entry), lookup)
    if first.role == COLOCATED:
        return Slot(colocated=first)
    consumer = policy.choose(CONSUMER_POOL, consumers, lookup)
    if local is not None and lookup is not None:
        why = local.reason(lookup, consumer, usable(PRODUCER))
        local.count(why)
        if why:
            return Slot(colocated=consumer)
    return Slot(producer=first, consumer=consumer)


def _sorted(ws: list[WorkerInfo]) -> list[WorkerInfo]:
    return sorted(ws, key=lambda w: w.worker_id)
