"""Runs a sweep of load points against one or more targets and builds the result document."""

from __future__ import annotations

import asyncio
import math
import os
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from deploy.benchmark.backend import Backend, SamplingChoice
from deploy.benchmark.clusters import DeviceCluster, Target
from deploy.benchmark.load import LoadPoint, run_requests
from deploy.benchmark.metrics import DEFAULT_PERCENTILES, PointContext, summarize
from deploy.benchmark.progress import Progress
from deploy.benchmark.workload import RequestSpec

BackendFactory = Callable[[Target], Backend]


@dataclass
class SweepPlan:
    points: list[LoadPoint]
    specs: list[RequestSpec]  # the measured workload, identical for every target
    warmup: list[RequestSpec]  # sent once per target before its first point, never measured
    sampling: SamplingChoice
    seed: int = 0
    slos: dict[str, float] = field(default_factory=dict)
    percentiles: Sequence[float] = DEFAULT_PERCENTILES
    keep_requests: bool = True  # per-request rows in the JSON (CDF plots need them)
    log_dir: str | None = None  # cluster process logs, one folder per target
    gpus: int | None = None  # override the GPU count used for per-GPU throughput


def rate_json(rate: float) -> float | str:
    return "inf" if math.isinf(rate) else rate


async def run_points(backend: Backend, target: Target, plan: SweepPlan,
                      gpus: int) -> dict[str, Any]:
    await backend.open()
    try:
        workers = await backend.workers()
        points = []
        if plan.warmup:  # once per target: compiles kernels and fills pools before any point
            # At least one warm-up per worker: round-robin pairing would leave some cold.
            n = max(len(plan.warmup), workers)
            specs = [plan.warmup[i % len(plan.warmup)] for i in range(n)]
            await run_requests(backend, specs, LoadPoint(n, math.inf), plan.sampling, plan.seed)
        for point in plan.points:
            prog = Progress(f"{target.label} {point.label}", len(plan.specs))
            records, dur = await run_requests(backend, plan.specs, point, plan.sampling,
                                              plan.seed, prog)
            metrics = summarize(records, PointContext(dur, workers, gpus), plan.slos,
                                plan.percentiles)
            row: dict[str, Any] = {"label": point.label, "concurrency": point.concurrency,
                                   "rate": rate_json(point.rate), "metrics": metrics}
            if plan.keep_requests:
                row["requests"] = [r.to_json() for r in records]
            points.append(row)
        return {"label": target.label, "target": target.describe(), "backend": backend.name,
                "workers": workers, "gpus": gpus, "points": points}
    finally:
        await backend.close()


def run_target(target: Target, plan: SweepPlan, make_backend: BackendFactory) -> dict[str, Any]:
    """Starts the target's cluster when it has one, runs every point, stops the cluster."""
    if target.spec is None:
        return asyncio.run(run_points(make_backend(target), target, plan, plan.gpus or 0))
    log_dir = os.path.join(plan.log_dir, target.label.replace(" ", "_")) if plan.log_dir else None
    cluster = DeviceCluster(target.spec, target.devices, log_dir=log_dir)
    print(f"starting cluster {target.label} ...", file=sys.stderr, flush=True)
    t0 = time.monotonic()
    cluster.start()
    print(f"cluster {target.label} ready in {time.monotonic() - t0:.1f}s", file=sys.stderr,
          flush=True)
    try:
        http = f"http://{target.spec.host}:{cluster.http_port}" if cluster.http_port > 0 else ""
        live = Target(target.label, address=cluster.router_address, base_url=http)
        result = asyncio.run(run_points(make_backend(live), live, plan,
                                         plan.gpus if plan.gpus is not None else cluster.gpus))
        result["target"] = target.describe()
        return result
    finally:
        cluster.stop()


def run_sweep(targets: Sequence[Target], plan: SweepPlan, make_backend: BackendFactory,
              on_target: Callable[[list[dict[str, Any]]], None] | None = None
              ) -> list[dict[str, Any]]:
    """``on_target`` sees the results so far after each target (to save partial results)."""
    done: list[dict[str, Any]] = []
    for t in targets:
        done.append(run_target(t, plan, make_backend))
        if on_target is not None:
            on_target(done)
    return done
