"""Which requests a step computes, and how much of each: the batch-forming policy of
continuous batching with chunked prefill, on any request type and block accounting.

1. Running requests first, in arrival order, each taking as many of its remaining
   positions as the token budget leaves.
2. When the blocks for a running request's chunk run out, the newest running request is
   preempted (its blocks freed, its KV recomputed later, back at the head of the queue),
   until the chunk fits or the request itself was the one preempted.
3. Then waiting requests are admitted in order while budget, seats and blocks last; none in
   a step that preempted (the freed blocks just went to someone who needed them).

The engine's ``Scheduler`` runs it over real requests and the block manager (prefix cache
included); the ratio planner's simulated worker (``deploy/plan/sim_worker.py``) over
counters. ``BatchPool`` is what each supplies: nothing here touches a model or a tensor.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Generic, Protocol, TypeVar

R = TypeVar("R")
R_in = TypeVar("R_in", contravariant=True)


class BatchPool(Protocol[R_in]):
    """How one scheduler keeps its requests' positions and blocks."""

    def finished(self, req: R_in) -> bool:
        """A running request that computes nothing more (it ends when its step is read)."""

    def computed(self, req: R_in) -> int:
        """Positions whose KV is computed: where its next chunk starts."""

    def remaining(self, req: R_in) -> int:
        """Positions known and not computed yet."""

    def grow(self, req: R_in, upto: int) -> bool:
        """Gives ``req`` the blocks for its first ``upto`` positions; False, taking none,
        when the pool has too few free."""

    def preempt(self, req: R_in) -> None:
        """Frees ``req``'s blocks and forgets its computed KV (it is queued again)."""

    def seats(self) -> int:
        """Requests that may still join the running set."""

    def admission(self, req: R_in, budget: int) -> tuple[int, int] | None:
        """Where a waiting request would start and how many positions it would compute
        under ``budget``; None while its blocks do not fit."""

    def admit(self, req: R_in, start: int, n: int) -> None:
        """Takes a waiting request in: its blocks for positions [0, start + n)."""


@dataclass
class Batch(Generic[R]):
    chunks: list[tuple[R, int, int]] = field(default_factory=list)  # (request, start, n)
    preempted: list[R] = field(default_factory=list)
    budget_left: int = 0


def form_batch(running: list[R], waiting: deque[R], budget: int,
               pool: BatchPool[R]) -> Batch[R]:
    """One step's batch; moves requests between ``running`` and ``waiting`` as it admits
    and preempts them."""
    out: Batch[R] = Batch()
    i = 0
    while i < len(running) and budget > 0:
        req = running[i]
        if pool.finished(req):
            i += 1
            continue
        n = min(pool.remaining(req), budget)
        start = pool.computed(req)
        while not pool.grow(req, start + n):
            victim = running.pop()
            pool.preempt(victim)
            waiting.appendleft(victim)
            out.preempted.append(victim)
            if victim is req:
                break
        else:
            out.chunks.append((req, start, n))
            budget -= n
            i += 1
    while waiting and budget > 0 and not out.preempted and pool.seats() > 0:
        req = waiting[0]
        plan = pool.admission(req, budget)
        if plan is None:
            break
        waiting.popleft()
        start, n = plan
        pool.admit(req, start, n)
        running.append(req)
        out.chunks.append((req, start, n))
        budget -= n
    out.budget_left = budget
    return out
