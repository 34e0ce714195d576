"""The router's Prometheus metrics: per-request latencies and outcomes, admission queue,
requests in flight by lifecycle state, prefill retries, and every worker's last reported
load (so one scrape of the router shows the cluster).

A private CollectorRegistry per router: tests run several routers in one process.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

from pdserve.v1 import common_pb2, router_pb2
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from router.control.registry import ROLE_NAMES, Registry
from router.requests.admission import Admission
from router.requests.dispatcher import Dispatcher
from router.requests.loop_metrics import LoopCounter, LoopHistogram
from router.requests.run_phase import RunPhase

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
# Latencies from a CPU test cluster (~10 ms/token) to a long GPU prefill queue (minutes).
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 0.75,
                   1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0)
FINISH_NAMES = {common_pb2.FINISH_REASON_STOP: "stop", common_pb2.FINISH_REASON_LENGTH: "length",
                common_pb2.FINISH_REASON_ABORT: "abort", common_pb2.FINISH_REASON_ERROR: "error"}


class RouterMetrics:
    def __init__(self, registry: Registry, admission: Admission, dispatcher: Dispatcher) -> None:
        self.prom = CollectorRegistry(auto_describe=True)
        r = self.prom

        def hist(name: str, doc: str) -> Histogram:
            return Histogram(name, doc, buckets=LATENCY_BUCKETS, registry=r)

        self.requests = Counter("pdserve_router_requests", "Requests by front door and outcome "
                                "(stop, length, abort, error, cancelled, or the refusal's "
                                "status such as invalid_argument, resource_exhausted)",
                                ["api", "outcome"], registry=r)
        self.prompt_tokens = Counter("pdserve_router_prompt_tokens",
                                     "Prompt tokens of finished requests", registry=r)
        # per message: the loop's own (lock-free) kinds
        self.generation_tokens = LoopCounter("pdserve_router_generation_tokens",
                                             "Tokens streamed to clients", r)
        self.aborts = Counter("pdserve_router_aborts", "Requests ended early, by who ended them",
                              ["reason"], registry=r)
        self.ttft = hist("pdserve_router_time_to_first_token_seconds",
                         "Request received -> token 0 sent to the client")
        self.tt2t = hist("pdserve_router_time_to_second_token_seconds",
                         "Token 0 sent -> token 1 sent (the consumer's KV wait shows here)")
        self.itl = LoopHistogram("pdserve_router_inter_token_latency_seconds",
                                 "Gap between later tokens, per token", LATENCY_BUCKETS, r)
        self.e2e = hist("pdserve_router_e2e_request_latency_seconds",
                        "Request received -> last message sent")
        self.hold = hist("pdserve_router_first_token_hold_seconds",
                         "Producer sampled token 0 -> router sent it (wall clocks)")
        self.kv_transfer = hist("pdserve_router_kv_transfer_seconds",
                                "First KV push -> consumer ack, as producers report it")
        r.register(_ClusterCollector(registry, admission, dispatcher))

    def render(self) -> bytes:
        return generate_latest(self.prom)

    def observe(self, api: str) -> RequestObserver:
        return RequestObserver(self, api)

    def refused(self, api: str, code_name: str) -> None:
        self.requests.labels(api, code_name.lower()).inc()


class RequestObserver:
    """Feeds one request's responses into the histograms as they are sent."""

    def __init__(self, metrics: RouterMetrics, api: str) -> None:
        self.m = metrics
        self.api = api
        self.start = time.monotonic()
        self.last = 0.0  # when the previous token-carrying message was sent
        self.tokens = 0
        self.done = False

    def on_response(self, resp: router_pb2.GenerateResponse) -> None:
        now = self.on_tokens(len(resp.token_ids))
        if resp.finish_reason:
            self._finish(resp, now)

    def on_tokens(self, n: int) -> float:
        """A message of ``n`` tokens that does not end the request went out (the steady
        state, without reading the message back); returns when."""
        now = time.monotonic()
        if n:
            m = self.m
            gap = now - self.last
            if self.tokens > 1:  # the steady state: every token of it has a gap
                itl = n
            elif self.tokens == 0:
                m.ttft.observe(now - self.start)
                itl = 0  # tokens batched with token 0 (colocated) carry no gap of their own
            else:
                m.tt2t.observe(gap)
                itl = n - 1
            # A message carrying k tokens spreads its gap evenly over them.
            for _ in range(itl):
                m.itl.observe(gap / n)
            self.tokens += n
            self.last = now
            m.generation_tokens.inc(n)
        return now

    def _finish(self, resp: router_pb2.GenerateResponse, now: float) -> None:
        self.done = True
        outcome = FINISH_NAMES.get(resp.finish_reason, "error")
        self.m.requests.labels(self.api, outcome).inc()
        if outcome == "abort":
            self.m.aborts.labels("client_abort").inc()
        self.m.e2e.observe(now - self.start)
        self.m.prompt_tokens.inc(resp.usage.prompt_tokens)
        t = resp.timing
        if t.producer_token0_sampled_ns and t.router_token0_sent_ns:
            self.m.hold.observe(max(0, t.router_token0_sent_ns - t.producer_token0_sampled_ns)
                                / 1e9)
        if t.kv_transfer_ms:
            self.m.kv_transfer.observe(t.kv_transfer_ms / 1e3)

    def cancelled(self) -> None:
        """The client went away before the last message."""
        if not self.done:
            self.done = True
            self.m.requests.labels(self.api, "cancelled").inc()
            self.m.aborts.labels("client_disconnect").inc()


class _ClusterCollector(Collector):
    """Gauges read at scrape time: nothing to keep in sync with the registry."""

    def __init__(self, registry: Registry, admission: Admission, dispatcher: Dispatcher) -> None:
        self.registry = registry
        self.admission = admission
        self.dispatcher = dispatcher

    def collect(self) -> Iterator[Metric]:
        a = self.admission
        yield GaugeMetricFamily("pdserve_router_requests_running",
                                "Requests holding an admission slot", value=a.running)
        yield GaugeMetricFamily("pdserve_router_requests_queued",
                                "Requests waiting for an admission slot", value=a.queued)
        yield GaugeMetricFamily("pdserve_router_requests_queued_limit",
                                "--max-queued-requests", value=a.max_queued)
        by_state = GaugeMetricFamily("pdserve_router_requests_in_state",
                                     "Requests the router holds, by lifecycle state",
                                     labels=["state"])
        states = {s.name: 0 for s in RunPhase if not s.finished}
        for info in self.dispatcher.requests():
            states[info.state.name] = states.get(info.state.name, 0) + 1
        for name, n in states.items():
            by_state.add_metric([name], n)
        yield by_state
        yield CounterMetricFamily("pdserve_router_prefill_retries",
                                  "Requests placed again after their producer failed before "
                                  "token 0", value=self.dispatcher.prefill_retries)
        local = CounterMetricFamily("pdserve_router_prefill_placement",
                                    "New P/D placements by where the prompt was prefilled: "
                                    "short_tail and producers_saturated on the consumer "
                                    "itself, remote on a producer", labels=["decision"])
        for why, n in self.dispatcher.local_prefill.decisions.items():
            local.add_metric([why], n)
        yield local
        index = self.dispatcher.kv_index
        yield GaugeMetricFamily("pdserve_router_kv_index_blocks",
                                "Prefix-cache block hashes the router's index holds, over all "
                                "workers", value=index.total())
        yield CounterMetricFamily("pdserve_router_kv_index_resyncs",
                                  "Workers' index views dropped for a gap, a new epoch or a "
                                  "new registration (a snapshot follows)", value=index.resyncs)
        yield CounterMetricFamily("pdserve_router_migrations",
                                  "Requests moved to another worker after a later failure, "
                                  "with the tokens already streamed",
                                  value=self.dispatcher.migrations)
        reg = self.registry
        yield GaugeMetricFamily("pdserve_router_loop_lag_seconds",
                                "How late the router's event loop ran its last liveness tick",
                                value=reg.loop_lag_s)
        yield CounterMetricFamily("pdserve_router_heartbeat_stall_credit_seconds",
                                  "Router loop stalls credited to every worker's heartbeat "
                                  "age (heartbeats it could not process)",
                                  value=reg.stall_credit_s)
        busy = GaugeMetricFamily("pdserve_worker_busy",
                                 "1 while the worker reports itself behind (--busy-lag, "
                                 "--busy-engine-age): it keeps its requests but gets no new "
                                 "ones",
                                 labels=["worker", "role"])
        healthy = GaugeMetricFamily("pdserve_router_workers",
                                    "Registered workers by role and health",
                                    labels=["role", "healthy"])
        counts: dict[tuple[str, str], int] = {(n, h): 0 for n in ROLE_NAMES.values()
                                              for h in ("true", "false")}
        fields = {
            "waiting": "Requests queued on the worker (consumers: waiting for KV blocks)",
            "running": "Requests running on the worker",
            "kv_blocks_used": "KV blocks in use",
            "kv_blocks_total": "KV blocks in the pool",
            "transfers_in_flight": "KV transfers in flight",
            "inflight": "Requests the router has dispatched to the worker",
            "loop_lag_seconds": "How far behind the worker's gRPC event loop runs",
            "engine_report_age_seconds": "Age of the engine process's last load report",
        }
        fams = {k: GaugeMetricFamily(f"pdserve_worker_{k}", f"{doc} (last heartbeat)",
                                     labels=["worker", "role"]) for k, doc in fields.items()}
        indexed = GaugeMetricFamily(
            "pdserve_worker_kv_index_blocks",
            "Prefix-cache blocks the router's index holds for the worker (from its KV events: "
            "what cache-aware placement sees of it)", labels=["worker", "role"])
        for w in self.registry.all():
            indexed.add_metric([w.worker_id, w.role_name], self.dispatcher.kv_index.size(w))
            counts[(w.role_name, "true" if w.healthy else "false")] += 1
            load = w.load
            vals = {"waiting": load.waiting, "running": load.running,
                    "kv_blocks_used": max(0, load.kv_blocks_total - load.kv_blocks_free),
                    "kv_blocks_total": load.kv_blocks_total,
                    "transfers_in_flight": load.transfers_in_flight, "inflight": w.inflight,
                    "loop_lag_seconds": load.loop_lag_s,
                    "engine_report_age_seconds": load.engine_report_age_s}
            for k, v in vals.items():
                fams[k].add_metric([w.worker_id, w.role_name], v)
            busy.add_metric([w.worker_id, w.role_name],
                            1 if reg.busy_reason(w) else 0)
        for (role, h), n in sorted(counts.items()):
            healthy.add_metric([role, h], n)
        yield healthy
        yield busy
        yield from fams.values()
        yield indexed
