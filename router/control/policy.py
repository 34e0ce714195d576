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
class narrow; the pool name lets stateful policies keep per-pool state.
"""

from __future__ import annotations

import itertools
import random
from abc import ABC, abstractmethod
from collections.abc import Collection, Sequence
from dataclasses import dataclass

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
    def choose(self, pool: str, candidates: Sequence[WorkerInfo]) -> WorkerInfo:
        """One of ``candidates`` (non-empty, sorted by worker id) for the next request."""


class RoundRobin(Policy):
    name = "round_robin"

    def __init__(self) -> None:
        self._counters: dict[str, itertools.count[int]] = {}

    def choose(self, pool: str, candidates: Sequence[WorkerInfo]) -> WorkerInfo:
        n = next(self._counters.setdefault(pool, itertools.count()))
        return candidates[n % len(candidates)]


class LeastLoaded(Policy):
    name = "least_loaded"

    def choose(self, pool: str, candidates: Sequence[WorkerInfo]) -> WorkerInfo:
        # Ties (e.g. an idle cluster) go to the worker given the fewest requests so far, so
        # equal workers share the work instead of the first one taking it all.
        return min(candidates, key=lambda w: (load_score(w), w.dispatched, w.worker_id))


class PowerOfTwo(Policy):
    """Two distinct random candidates, the less loaded wins: near least-loaded balance
    without every router herding onto the same worker between heartbeats."""

    name = "power_of_two"

    def __init__(self, rng: random.Random | None = None) -> None:
        self._rng = rng or random.Random()

    def choose(self, pool: str, candidates: Sequence[WorkerInfo]) -> WorkerInfo:
        if len(candidates) == 1:
            return candidates[0]
        a, b = self._rng.sample(list(candidates), 2)
        return b if load_score(b) < load_score(a) else a


POLICIES: dict[str, type[Policy]] = {p.name: p for p in (RoundRobin, LeastLoaded, PowerOfTwo)}


def make_policy(name: str) -> Policy:
    if name not in POLICIES:
        raise ValueError(f"--policy: must be one of {', '.join(POLICIES)}, got {name!r}")
    return POLICIES[name]()


@dataclass(frozen=True)
class Slot:
    """Where one request runs: ``colocated`` alone, or ``producer`` with ``consumer``."""

    producer: WorkerInfo | None = None
    consumer: WorkerInfo | None = None
    colocated: WorkerInfo | None = None

    @property
    def workers(self) -> list[WorkerInfo]:
        return [w for w in (self.producer, self.consumer, self.colocated) if w is not None]


def place(registry: Registry, policy: Policy,
          exclude: Collection[WorkerInfo] = (), *, busy_ok: bool = False) -> Slot | None:
    """A slot for the next request, or None when the cluster cannot serve one.

    exclude: registrations (any role) a retried or migrated request already failed on; a
    worker that registered again since (a restart) is a new one and may be picked.
    busy_ok: busy workers (behind, ``Registry.placeable``) may be picked too; new requests
    never go to them, but a running request that lost its worker is better off there than
    failed.
    """
    gone = {id(w) for w in exclude}
    pool = registry.usable if busy_ok else registry.placeable

    def usable(role: int) -> list[WorkerInfo]:
        return [w for w in pool(role) if id(w) not in gone]

    consumers = _sorted(usable(CONSUMER))
    entry = usable(COLOCATED)
    if consumers:
        entry += usable(PRODUCER)
    if not entry:
        return None
    first = policy.choose(ENTRY_POOL, _sorted(entry))
    if first.role == COLOCATED:
        return Slot(colocated=first)
    return Slot(producer=first, consumer=policy.choose(CONSUMER_POOL, consumers))


def _sorted(ws: list[WorkerInfo]) -> list[WorkerInfo]:
    return sorted(ws, key=lambda w: w.worker_id)
