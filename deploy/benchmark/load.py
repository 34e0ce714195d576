"""Drives one benchmark point: warm-up, then the workload at a concurrency cap and/or a
Poisson arrival rate (``inf``: every request at once), as ``vllm bench serve`` does."""

from __future__ import annotations

import asyncio
import math
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass

from deploy.benchmark.backend import Backend, SamplingChoice
from deploy.benchmark.progress import Progress
from deploy.benchmark.record import RequestRecord
from deploy.benchmark.workload import RequestSpec
from worker.heap import freeze_startup_heap


@dataclass(frozen=True)
class LoadPoint:
    concurrency: int | None  # cap on requests in flight (None: no cap)
    rate: float  # requests per second, Poisson arrivals; math.inf sends all at once

    @property
    def label(self) -> str:
        parts = []
        if self.concurrency is not None:
            parts.append(f"c={self.concurrency}")
        if not math.isinf(self.rate) or self.concurrency is None:
            parts.append(f"rate={self.rate:g}")
        return " ".join(parts)


def arrival_offsets(n: int, rate: float, seed: int) -> list[float]:
    """Send times (s from the start): exponential gaps of mean 1/rate, seeded."""
    if math.isinf(rate):
        return [0.0] * n
    rng = random.Random(seed)
    t, out = 0.0, []
    for _ in range(n):
        out.append(t)
        t += rng.expovariate(rate)
    return out


async def run_requests(backend: Backend, specs: Sequence[RequestSpec], point: LoadPoint,
                       sampling: SamplingChoice, seed: int,
                       progress: Progress | None = None) -> tuple[list[RequestRecord], float]:
    """Sends every spec under ``point``; returns one record per spec and the wall time."""
    sem = asyncio.Semaphore(point.concurrency) if point.concurrency else None
    offsets = arrival_offsets(len(specs), point.rate, seed)
    if specs and all(s.at_s is not None for s in specs):  # a replayed trace's own arrivals
        offsets = [s.at_s or 0.0 for s in specs]
    records = [RequestRecord(i, s.prompt_len, s.output_len, ideal_cached=s.ideal_cached)
               for i, s in enumerate(specs)]
    # a full collection walking the client's imports and earlier points' records would show
    # up in this point's inter-token gaps as the server's (worker/heap.py)
    freeze_startup_heap()
    t0 = time.perf_counter()

    async def one(i: int) -> None:
        delay = t0 + offsets[i] - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        if sem is not None:
            async with sem:  # the clock starts once it may be sent, as in vLLM
                await _send(backend, specs[i], records[i], sampling)
        else:
            await _send(backend, specs[i], records[i], sampling)
        if progress is not None:
            progress.update(records[i].success)

    await asyncio.gather(*(one(i) for i in range(len(specs))))
    return records, time.perf_counter() - t0


async def _send(backend: Backend, spec: RequestSpec, rec: RequestRecord,
                sampling: SamplingChoice) -> None:
    try:
        await backend.send(spec, rec, sampling)
    except Exception as e:  # a client-side bug still counts as a failed request, visibly
        rec.error, rec.success = f"client: {type(e).__name__}: {e}", False
        rec.end = time.perf_counter()
