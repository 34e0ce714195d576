"""Discrete-event simulator of a pdserve cluster, driven by a worker profile.

Time advances from event to event: an arrival, a worker's step ending, a request's KV
landing on its consumer. The request flow is in docs/architecture.md: the router places each
request by policy (``router/control/policy.py``'s entry pool of colocated workers and producers,
then a consumer); the consumer reserves blocks for the prompt at once or queues the
reservation until blocks free; the producer runs chunked prefill under the engine's rules
and pushes each chunk's KV when the reservation is known, over its link at the profile's
bandwidth; token 0 reaches the client at the end of the producer's last chunk; the producer
frees its blocks when the last push lands; the consumer then admits the request to decode.
What it leaves out: router and gRPC hops, deferred output's one-step delay, heartbeat
staleness (the router's load view is exact here).
"""

from __future__ import annotations

import heapq
import itertools
import random
from array import array
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from deploy.benchmark.metrics import PointContext, summarize
from deploy.benchmark.record import RequestRecord
from deploy.plan.profile import Profile
from deploy.plan.sim_worker import (
    COLOCATED,
    CONSUMER,
    PRODUCER,
    EngineLimits,
    SimRequest,
    SimWorker,
)
from router.control.policy import KV_WEIGHT

POLICIES = ("round_robin", "least_loaded", "power_of_two")
_ARRIVE, _STEP, _LAND = 0, 1, 2


@dataclass(frozen=True)
class Split:
    producers: int
    consumers: int
    colocated: int

    def __post_init__(self) -> None:
        if min(self.producers, self.consumers, self.colocated) < 0:
            raise ValueError(f"split: counts must be >= 0, got {self}")
        if (self.producers == 0) != (self.consumers == 0):
            raise ValueError("split: producers and consumers come together (both or neither)")
        if self.workers == 0:
            raise ValueError("split: needs at least one worker")

    @property
    def workers(self) -> int:
        return self.producers + self.consumers + self.colocated

    def label(self) -> str:
        parts = []
        if self.producers:
            parts.append(f"{self.producers}P{self.consumers}D")
        if self.colocated:
            parts.append(f"{self.colocated}C")
        return "+".join(parts)


@dataclass(frozen=True)
class Arrival:
    time_s: float
    prompt_len: int
    output_len: int


class _Router:
    def __init__(self, policy: str, seed: int) -> None:
        if policy not in POLICIES:
            raise ValueError(f"--policy: must be one of {', '.join(POLICIES)}, got {policy!r}")
        self.policy = policy
        self.rr: dict[str, Any] = {}
        self.rng = random.Random(seed)

    def choose(self, pool: str, cands: list[SimWorker]) -> SimWorker:
        if len(cands) == 1:
            w = cands[0]
        elif self.policy == "round_robin":
            n = next(self.rr.setdefault(pool, itertools.count()))
            w = cands[n % len(cands)]
        elif self.policy == "least_loaded":
            w = min(cands, key=lambda c: (c.load_score(KV_WEIGHT), c.dispatched, c.wid))
        else:
            a, b = self.rng.sample(cands, 2)
            w = b if b.load_score(KV_WEIGHT) < a.load_score(KV_WEIGHT) else a
        w.dispatched += 1
        return w


class Simulation:
    def __init__(self, profile: Profile, split: Split, limits: EngineLimits | None = None,
                 policy: str = "round_robin", seed: int = 0) -> None:
        self.profile = profile
        self.split = split
        limits = limits or EngineLimits()
        roles = ([PRODUCER] * split.producers + [CONSUMER] * split.consumers
                 + [COLOCATED] * split.colocated)
        self.workers = [SimWorker(i, r, profile, limits) for i, r in enumerate(roles)]
        self.entry = [w for w in self.workers if w.role != CONSUMER]
        self.consumers = [w for w in self.workers if w.role == CONSUMER]
        self.router = _Router(policy, seed)
        self.events: list[tuple[float, int, int, Any]] = []
        self.seq = itertools.count()
        self.now = 0.0
        self.max_len = profile.kv_capacity_tokens

    def _push(self, t: float, kind: int, obj: Any) -> None:
        heapq.heappush(self.events, (t, next(self.seq), kind, obj))

    def run(self, arrivals: Sequence[Arrival]) -> list[SimRequest]:
        reqs = [SimRequest(i, a.prompt_len, a.output_len, a.time_s)
                for i, a in enumerate(arrivals)]
        for r in reqs:
            self._push(r.arrival, _ARRIVE, r)
        while self.events:
            t, _, kind, obj = heapq.heappop(self.events)
            self.now = t
            if kind == _STEP:
                self._step_end(obj)
            elif kind == _ARRIVE:
                self._arrive(obj)
            else:
                self._land(obj)
        return reqs

    # -- the request's path -----------------------------------------------------------------

    def _arrive(self, req: SimRequest) -> None:
        if req.prompt_len + req.output_len > self.max_len:
            req.error = (f"prompt + output ({req.prompt_len + req.output_len} tokens) exceed "
                         f"the KV pool ({self.max_len} tokens)")
            return
        w = self.router.choose("entry", self.entry)
        w.inflight += 1
        if w.role == PRODUCER:
            c = self.router.choose("consumer", self.consumers)
            c.inflight += 1
            req.producer, req.consumer = w, c
            c.reservations.append(req)
            self._interrupt(c)  # blocks a bundle took ahead would be free in the engine
            self._grant(c)
        w.waiting.append(req)
        self._interrupt(w)
        self._wake(w)

    def _grant(self, c: SimWorker) -> None:
        """Reservations are granted in order while the consumer has blocks for the prompt."""
        while c.reservations:
            req = c.reservations[0]
            need = -(-req.prompt_len // c.bs)
            if need > c.free:
                return
            c.reservations.popleft()
            c.free -= need
            req.reserved = True
            if req.computed:  # chunks computed before the destination was known go now
                self._transfer(req, req.computed, self.now)

    def _transfer(self, req: SimRequest, tokens: int, ready: float) -> None:
        p = req.producer
        assert p is not None
        req.pushed += tokens
        start = max(ready, p.link_free_at)
        p.link_free_at = start + self.profile.transfer_ms(tokens) / 1e3
        if req.pushed == req.prompt_len:  # the final push: its landing admits the request
            self._push(p.link_free_at, _LAND, req)

    def _land(self, req: SimRequest) -> None:
        p, c = req.producer, req.consumer
        assert p is not None and c is not None
        req.landed_at = self.now
        p.release(req)
        p.inflight -= 1
        self._wake(p)
        req.blocks = -(-req.prompt_len // c.bs)  # the reservation becomes its blocks
        req.computed = req.prompt_len
        if len(req.token_times) >= req.output_len:  # token 0 was its only token
            c.release(req)
            c.inflight -= 1
            self._grant(c)
            return
        req.num_tokens = req.prompt_len + 1
        c.running.append(req)
        self._interrupt(c)
        self._wake(c)

    # -- steps ------------------------------------------------------------------------------

    def _wake(self, w: SimWorker) -> None:
        if w.busy or not w.has_work():
            return
        chunks = w.schedule()
        if not chunks:
            return
        w.busy = True
        w.pending = chunks
        w.ends = w.bundle(chunks, self.now)
        w.gen += 1
        self._push(w.ends[-1], _STEP, (w, w.gen))

    def _interrupt(self, w: SimWorker) -> None:
        """New work for ``w``: a bundle of decode steps in flight stops at the next step end."""
        end = w.cut(self.now)
        if end is not None:
            w.untake(w.pending, len(w.ends))
            self._push(end, _STEP, (w, w.gen))

    def _step_end(self, event: tuple[SimWorker, int]) -> None:
        w, gen = event
        if gen != w.gen:
            return  # a bundle cut short: its step end moved
        chunks = w.pending
        w.busy = False
        now = self.now
        for req, i in w.deferred:  # the step before this one: read once its successor ran
            req.token_times[i] = w.ends[0]
        w.deferred.clear()
        done: list[SimRequest] = []
        if len(w.ends) > 1:
            self._bundle_end(w, done)
            chunks = []
        for ch in chunks:
            req = ch.req
            req.computed = ch.start + ch.n
            if w.role == PRODUCER:
                if req.computed == req.prompt_len:
                    req.token_times.append(now)
                    req.prefilled_at = now
                    done.append(req)
                if req.reserved and req.computed > req.pushed:  # KV goes out per chunk
                    self._transfer(req, req.computed - req.pushed, now)
                continue
            if req.computed == req.num_tokens:
                if len(req.token_times) < req.output_len:
                    req.token_times.append(now)
                    if w.defers:
                        w.deferred.append((req, len(req.token_times) - 1))
                if len(req.token_times) >= req.output_len:
                    done.append(req)
                else:
                    req.num_tokens += 1
        for req in done:
            w.running.remove(req)
            w.trim(req)
            if w.role == PRODUCER:
                continue  # its blocks stay until the last push lands
            w.release(req)
            w.inflight -= 1
            if w.role == CONSUMER:
                self._grant(w)
        self._wake(w)
        if not w.busy:  # nothing launched after it: the engine reads the step's output now
            w.deferred.clear()


    def _bundle_end(self, w: SimWorker, done: list[SimRequest]) -> None:
        k = len(w.ends)
        for ch in w.pending:
            req = ch.req
            req.computed = ch.start + k
            n0 = len(req.token_times)
            req.token_times.extend(w.ends)
            if w.defers:  # each bundled step's tokens show at the next step's end
                req.token_times[n0:n0 + k - 1] = array("d", w.ends[1:])
                w.deferred.append((req, n0 + k - 1))
            if len(req.token_times) >= req.output_len:
                done.append(req)
            else:
                req.num_tokens = req.computed + 1
                w.trim(req)


class SimRecord(RequestRecord):
    """A bench record whose token arrivals are the simulated request's time array (no
    per-token tuples: a 64-worker, 10-minute run has tens of millions of tokens)."""

    times: Any = None

    @property
    def ttft(self) -> float | None:
        return self.times[0] - self.start if self.times else None

    @property
    def ttst(self) -> float | None:
        return self.times[1] - self.start if self.times is not None and len(self.times) > 1 \
            else None

    @property
    def itl(self) -> list[float]:
        t = self.times
        return [] if t is None else [t[i + 1] - t[i] for i in range(len(t) - 1)]


def records(reqs: Sequence[SimRequest]) -> list[RequestRecord]:
    out: list[RequestRecord] = []
    for r in reqs:
        rec = SimRecord(index=r.index, prompt_len=r.prompt_len,
                        expected_output_len=r.output_len, start=r.arrival)
        if r.error or len(r.token_times) < r.output_len:
            rec.error = r.error or "not finished"
        else:
            rec.success = True
            rec.finish_reason = "length"
            rec.times = r.token_times
            rec.end = r.token_times[-1]
            rec.output_tokens = r.output_len
            if r.prefilled_at is not None and r.landed_at is not None:
                rec.kv_transfer_ms = (r.landed_at - r.prefilled_at) * 1e3
        out.append(rec)
    return out


def served_ratio(reqs: Sequence[SimRequest]) -> float:
    """Completions over arrivals in the window from a quarter of the way through the
    arrivals to the last one: 1 in steady state (the flows out and in match, whatever the
    latency), the share of the rate the cluster can serve when it is overloaded."""
    if not reqs:
        return 1.0
    first, last = reqs[0].arrival, max(r.arrival for r in reqs)
    lo = first + (last - first) / 4
    arrived = sum(lo <= r.arrival <= last for r in reqs)
    done = sum(1 for r in reqs if len(r.token_times) == r.output_len and r.token_times
               and lo <= r.token_times[-1] <= last)
    return done / arrived if arrived else 1.0


def simulate(profile: Profile, split: Split, arrivals: Sequence[Arrival],
             limits: EngineLimits | None = None, policy: str = "round_robin",
             slos: dict[str, float] | None = None, seed: int = 0) -> dict[str, Any]:
    """``pdserve bench``'s metrics for ``arrivals`` served by ``split``."""
    reqs = Simulation(profile, split, limits, policy, seed).run(arrivals)
    recs = records(reqs)
    ok = [r for r in recs if r.success]
    dur = (max(r.end for r in ok) - min(r.start for r in ok)) if ok else 0.0
    m = summarize(recs, PointContext(duration_s=dur, workers=split.workers,
                                     gpus=split.workers), slos)
    m["served_ratio"] = served_ratio(reqs)
    m["split"] = {"producers": split.producers, "consumers": split.consumers,
                  "colocated": split.colocated}
    return m
