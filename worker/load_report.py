"""The load report: what a worker's engine process says of itself, every 0.25 s.

The role handler builds it (``RoleHandler.load``: the engine's queues, pool and counters;
a producer or consumer adds its transfer counters with ``dataclasses.replace``), the engine
loop adds the held-request rows and its step counters (``worker.engine_loop.load_report``),
and it crosses to the gRPC process as ``StatsEvent.load`` through the worker's checked codec.
There three readers take it by attribute: the heartbeat (``worker.loop_watch.load_pb``:
the router's ``WorkerLoad``), ``/metrics`` and ``/debug/requests``
(``worker.metrics_server``).

A role's own numbers live in a record of their own that is None for the other roles, so a
worker exports exactly the metric families of what it is (a consumer has no lease expiries,
a producer no local prefills).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the gRPC process reads reports and never imports the engine (torch)
    from engine.outputs import HeldRequest
    from engine.prefix_cache import PrefixCacheStats


@dataclass(frozen=True)
class DPRankLoad:
    """One attention data-parallel group's own queues and KV pool."""

    waiting: int
    running: int
    kv_blocks_free: int
    kv_blocks_total: int


@dataclass(frozen=True)
class PrefixCacheLoad:
    """The engine's prefix cache (engine/prefix_cache.py ``PrefixCacheStats``)."""

    enabled: bool = False
    queried_tokens: int = 0  # cumulative: prompt tokens looked up
    hit_tokens: int = 0  # cumulative: of those, found cached
    blocks: int = 0  # gauge: blocks holding cached KV, in use or not
    evictable_blocks: int = 0  # gauge: cached blocks no request uses (counted as free)
    evicted_blocks: int = 0  # cumulative: cached blocks reused for other KV
    kv_events_dropped: int = 0  # cumulative: events the bounded queue dropped unread

    @classmethod
    def of(cls, s: PrefixCacheStats) -> PrefixCacheLoad:
        return cls(s.enabled, s.queried_tokens, s.hit_tokens, s.cached_blocks,
                   s.evictable_blocks, s.evicted_blocks, s.kv_events_dropped)


@dataclass(frozen=True)
class HeldRow:
    """One request the engine holds, as GET /debug/requests lists it."""

    request_id: str
    state: str  # the engine's RequestState name
    age_s: float  # since the engine got it (ms resolution)
    state_age_s: float  # since its last state change (ms resolution)
    blocks: int  # KV blocks it holds, its own plus those pinned for a transfer

    @classmethod
    def of(cls, h: HeldRequest) -> HeldRow:
        return cls(h.request_id, h.state.name, round(h.age_s, 3), round(h.state_age_s, 3),
                   h.blocks)

    def to_json(self) -> dict[str, object]:
        return {"request_id": self.request_id, "state": self.state, "age_s": self.age_s,
                "state_age_s": self.state_age_s, "blocks": self.blocks}


@dataclass(frozen=True)
class StepCounters:
    """The engine loop's cumulative step counters (worker/step_stats.py): mean batch is
    rows / steps, mean step seconds / steps, mean host time between steps gap_seconds / gaps."""

    steps: int = 0
    rows: int = 0  # requests that got tokens, summed over steps
    tokens: int = 0
    seconds: float = 0.0  # wall time inside steps
    gap_seconds: float = 0.0  # wall time between consecutive steps
    gaps: int = 0


@dataclass(frozen=True)
class TransferLoad:
    """What a role that moves KV (producer, consumer) counts; cumulative but orphan_blocks."""

    orphan_blocks: int = 0  # gauge: blocks held past their lease by requests not moving
    transfers_ok: int = 0
    transfers_failed: int = 0  # failed or cancelled
    aborts: int = 0  # abort commands received
    kv_malformed_messages: int = 0  # KV-channel frames from peers dropped as malformed
    kv_rejected_handshakes: int = 0  # KV-channel handshakes refused


@dataclass(frozen=True)
class ProducerLoad:
    lease_expiries: int = 0  # leases that expired (blocks freed for want of a consumer)
    kv_bytes_sent: int = 0


@dataclass(frozen=True)
class ConsumerLoad:
    recomputed: int = 0  # admitted requests preempted: their transferred KV was dropped
    kv_bytes_received: int = 0  # completed transfers
    reservation_queue_full: int = 0  # decode requests refused for a full reservation queue
    local_prefills: int = 0  # requests the router had this consumer prefill itself


@dataclass(frozen=True)
class LoadReport:
    """The worker's totals first (over every data-parallel group), then what only some
    workers or only the engine loop fill in."""

    waiting: int  # requests queued (consumers: reservations waiting for blocks too)
    running: int
    kv_blocks_free: int
    kv_blocks_total: int
    transfers_in_flight: int = 0
    kv_exhausted_by_orphans: bool = False  # the pool is full of requests making no progress
    preemptions: int = 0  # cumulative
    dp_ranks: tuple[DPRankLoad, ...] = ()  # per group, in order; empty for one group
    prefix_cache: PrefixCacheLoad = field(default_factory=PrefixCacheLoad)
    transfer: TransferLoad | None = None  # producer and consumer
    producer: ProducerLoad | None = None
    consumer: ConsumerLoad | None = None
    # The engine loop's additions: the held requests (oldest first, at most
    # MAX_LISTED_REQUESTS of them), how many there are in all, and its step counters.
    requests: tuple[HeldRow, ...] = ()
    requests_held: int = 0
    steps: StepCounters = field(default_factory=StepCounters)
