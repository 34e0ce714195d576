"""A worker's Prometheus endpoint: a small aiohttp server in the worker's gRPC process.

Engine-side numbers (queue, KV blocks, transfers, leases, preemptions, engine steps) come
from the engine process's latest load report (worker/load_report.py, every 0.25 s), so
serving /metrics never touches the engine; per-RPC outcomes and transfer times are counted
here as they stream.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from worker.load_report import ConsumerLoad, LoadReport, ProducerLoad, TransferLoad

log = logging.getLogger("pdserve.worker")
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
TRANSFER_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
                    10.0, 30.0)
@dataclass(frozen=True)
class ServingCounters:
    """What the gRPC process counts itself, beside the engine process's load report."""

    output_batches: int = 0  # OutputBatch messages queued for routers' Outputs streams
    output_messages: int = 0  # per-request token messages in those batches
    kv_event_batches: int = 0  # prefix-cache event batches the router accepted
    kv_event_snapshots: int = 0  # snapshots sent to the router (resyncs)
    kv_events_dropped_pending: int = 0  # events replaced by a snapshot before sending


# What a metric reads: a number, or None when this worker has no such number (another
# role's counter; no report yet), and then the family is left out.
Getter = Callable[[LoadReport | None, ServingCounters | None], float | None]

def _report(get: Callable[[LoadReport], float]) -> Getter:
    return lambda r, s: None if r is None else get(r)


def _transfer(get: Callable[[TransferLoad], float]) -> Getter:
    return lambda r, s: None if r is None or r.transfer is None else get(r.transfer)


def _producer(get: Callable[[ProducerLoad], float]) -> Getter:
    return lambda r, s: None if r is None or r.producer is None else get(r.producer)


def _consumer(get: Callable[[ConsumerLoad], float]) -> Getter:
    return lambda r, s: None if r is None or r.consumer is None else get(r.consumer)


def _serving(get: Callable[[ServingCounters], float]) -> Getter:
    return lambda r, s: None if s is None else get(s)


# (metric name, help, what it reads): gauges, then cumulative counters.
_GAUGES: tuple[tuple[str, str, Getter], ...] = (
    ("pdserve_worker_prefix_cache_blocks",
     "KV blocks holding a cached prompt prefix (in use or not)",
     _report(lambda r: r.prefix_cache.blocks)),
    ("pdserve_worker_prefix_cache_evictable_blocks",
     "Cached blocks no request uses (counted as free)",
     _report(lambda r: r.prefix_cache.evictable_blocks)),
    ("pdserve_worker_queue_depth", "Requests waiting (consumers: for KV blocks)",
     _report(lambda r: r.waiting)),
    ("pdserve_worker_running_requests", "Requests in the engine's running set",
     _report(lambda r: r.running)),
    ("pdserve_worker_kv_blocks_total", "KV blocks in the pool",
     _report(lambda r: r.kv_blocks_total)),
    ("pdserve_worker_kv_blocks_free", "KV blocks free", _report(lambda r: r.kv_blocks_free)),
    ("pdserve_worker_kv_transfers_in_flight", "KV transfers in flight",
     _report(lambda r: r.transfers_in_flight)),
    ("pdserve_worker_kv_orphan_blocks",
     "KV blocks held past their lease by requests making no progress",
     _transfer(lambda t: t.orphan_blocks)),
    ("pdserve_worker_kv_exhausted_by_orphans",
     "1 when orphans exhaust the KV pool (the worker is unhealthy)",
     _report(lambda r: r.kv_exhausted_by_orphans)),
    ("pdserve_worker_kv_blocks_used", "KV blocks in use",
     _report(lambda r: r.kv_blocks_total - r.kv_blocks_free)),
)
_COUNTERS: tuple[tuple[str, str, Getter], ...] = (
    ("pdserve_worker_prefix_cache_queried_tokens",
     "Prompt tokens looked up in the prefix cache",
     _report(lambda r: r.prefix_cache.queried_tokens)),
    ("pdserve_worker_prefix_cache_hit_tokens",
     "Prompt tokens found in the prefix cache (not computed)",
     _report(lambda r: r.prefix_cache.hit_tokens)),
    ("pdserve_worker_prefix_cache_evicted_blocks", "Cached blocks evicted for new allocations",
     _report(lambda r: r.prefix_cache.evicted_blocks)),
    ("pdserve_worker_output_batches",
     "OutputBatch messages queued for routers' Outputs streams (one per engine step per "
     "router)", _serving(lambda s: s.output_batches)),
    ("pdserve_worker_output_messages", "Per-request token messages carried in those batches",
     _serving(lambda s: s.output_messages)),
    ("pdserve_worker_kv_event_batches", "Prefix-cache event batches the router accepted",
     _serving(lambda s: s.kv_event_batches)),
    ("pdserve_worker_kv_event_snapshots", "Prefix-cache snapshots sent to the router (resyncs)",
     _serving(lambda s: s.kv_event_snapshots)),
    ("pdserve_worker_kv_events_dropped_pending",
     "Prefix-cache events replaced by a snapshot before sending",
     _serving(lambda s: s.kv_events_dropped_pending)),
    ("pdserve_worker_lease_expiries", "Producer leases that expired",
     _producer(lambda p: p.lease_expiries)),
    ("pdserve_worker_aborts", "Abort commands received", _transfer(lambda t: t.aborts)),
    ("pdserve_worker_preemptions", "Requests preempted (KV dropped, recomputed)",
     _report(lambda r: r.preemptions)),
    ("pdserve_worker_consumer_recomputed",
     "Consumer requests that recomputed their prompt instead of using the transferred KV "
     "(preempted after admission)", _consumer(lambda c: c.recomputed)),
    ("pdserve_worker_kv_transfer_sent_bytes", "KV bytes pushed to consumers",
     _producer(lambda p: p.kv_bytes_sent)),
    ("pdserve_worker_kv_transfer_received_bytes",
     "KV bytes received from producers (completed transfers)",
     _consumer(lambda c: c.kv_bytes_received)),
    ("pdserve_worker_kv_transfers_ok", "KV transfers completed",
     _transfer(lambda t: t.transfers_ok)),
    ("pdserve_worker_kv_transfers_failed", "KV transfers failed/cancelled",
     _transfer(lambda t: t.transfers_failed)),
    ("pdserve_worker_consumer_local_prefills",
     "Requests the router had this consumer prefill itself (short uncached tail, or "
     "producers saturated)", _consumer(lambda c: c.local_prefills)),
    ("pdserve_worker_reservation_queue_full", "Decode requests refused: reservation queue full",
     _consumer(lambda c: c.reservation_queue_full)),
    ("pdserve_worker_kv_malformed_messages", "KV-channel frames from peers dropped as malformed",
     _transfer(lambda t: t.kv_malformed_messages)),
    ("pdserve_worker_kv_rejected_handshakes",
     "KV-channel handshakes refused (token, version, layout)",
     _transfer(lambda t: t.kv_rejected_handshakes)),
    # worker/step_stats.py: mean batch = rows / steps, mean step = seconds / steps, mean
    # host time between steps = gap seconds / gaps (rates of each, over any window)
    ("pdserve_worker_engine_steps", "Engine steps run", _report(lambda r: r.steps.steps)),
    ("pdserve_worker_engine_step_rows",
     "Requests that got tokens from an engine step, summed over steps",
     _report(lambda r: r.steps.rows)),
    ("pdserve_worker_engine_step_tokens", "Tokens engine steps reported",
     _report(lambda r: r.steps.tokens)),
    ("pdserve_worker_engine_step_seconds", "Wall seconds inside engine steps",
     _report(lambda r: r.steps.seconds)),
    ("pdserve_worker_engine_step_gap_seconds",
     "Wall seconds between consecutive engine steps (the engine process's own work between "
     "them: commands, role, transfers)", _report(lambda r: r.steps.gap_seconds)),
    ("pdserve_worker_engine_step_gaps", "Gaps summed in pdserve_worker_engine_step_gap_seconds",
     _report(lambda r: r.steps.gaps)),
)


class WorkerMetrics:
    """load: the engine process's latest report (None before the first); serving: what the
    gRPC process counts itself (None: nothing, as in a test of the report alone)."""

    def __init__(self, worker_id: str, role: str, load: Callable[[], LoadReport | None],
                 serving: Callable[[], ServingCounters | None] = lambda: None) -> None:
        self.prom = CollectorRegistry(auto_describe=True)
        self.requests = Counter("pdserve_worker_requests", "Prefill/Decode requests by outcome",
                                ["rpc", "outcome"], registry=self.prom)
        self.kv_transfer = Histogram("pdserve_worker_kv_transfer_seconds",
                                     "First KV push -> consumer ack (producer side)",
                                     buckets=TRANSFER_BUCKETS, registry=self.prom)
        self.prom.register(_LoadCollector(worker_id, role, load, serving))
        self.load = load

    def render(self) -> bytes:
        return generate_latest(self.prom)

    def held_requests(self) -> dict[str, Any]:
        """What GET /debug/requests shows: every request the engine holds, as of its latest
        load report (at most 0.25 s old)."""
        r = self.load()
        if r is None:
            return {"requests": [], "total": 0, "kv_blocks_total": 0, "kv_blocks_free": 0}
        return {"requests": [row.to_json() for row in r.requests], "total": r.requests_held,
                "kv_blocks_total": r.kv_blocks_total, "kv_blocks_free": r.kv_blocks_free}


class _LoadCollector(Collector):
    def __init__(self, worker_id: str, role: str, load: Callable[[], LoadReport | None],
                 serving: Callable[[], ServingCounters | None]) -> None:
        self.labels = [worker_id, role]
        self.load = load
        self.serving = serving

    def collect(self) -> Iterator[Metric]:
        report, serving = self.load(), self.serving()
        names = ["worker", "role"]
        for name, doc, get in _GAUGES:
            if (v := get(report, serving)) is not None:
                g = GaugeMetricFamily(name, doc, labels=names)
                g.add_metric(self.labels, float(v))
                yield g
        for name, doc, get in _COUNTERS:
            if (v := get(report, serving)) is not None:
                c = CounterMetricFamily(name, doc, labels=names)
                c.add_metric(self.labels, float(v))
                yield c


class MetricsServer:
    """Serves GET /metrics, and GET /debug/requests (JSON: request id, state, age and blocks
    of every request holding KV blocks), on its own port (0: any free port)."""

    def __init__(self, metrics: WorkerMetrics) -> None:
        self.metrics = metrics
        self.port = 0
        self._runner: web.AppRunner | None = None

    async def start(self, host: str, port: int) -> int:
        app = web.Application()
        app.router.add_get("/metrics", self._metrics)
        app.router.add_get("/debug/requests", self._requests)
        runner = web.AppRunner(app, access_log=None, shutdown_timeout=1.0)
        await runner.setup()
        try:
            await web.TCPSite(runner, host, port).start()
        except OSError as e:
            await runner.cleanup()
            raise ValueError(f"--metrics-port: cannot bind {host}:{port}: {e.strerror}") from e
        self._runner = runner
        self.port = int(runner.addresses[0][1])
        return self.port

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def _metrics(self, request: web.Request) -> web.Response:
        return web.Response(body=self.metrics.render(), headers={"Content-Type": CONTENT_TYPE})

    async def _requests(self, request: web.Request) -> web.Response:
        return web.json_response(self.metrics.held_requests())
