"""Prometheus metrics updated once per streamed message, for one event loop's use only.

``prometheus_client``'s Counter and Histogram take a lock per update (they may be updated
from any thread); the router updates its per-token series from its event loop alone and
renders them on the same loop (the HTTP door's /metrics), so plain integers do. A histogram
update is then one bisect and two additions instead of two locked increments and a linear
bucket search: the difference is about a microsecond per streamed message.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterator, Sequence

from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector, CollectorRegistry


class LoopHistogram(Collector):
    def __init__(self, name: str, doc: str, buckets: Sequence[float],
                 registry: CollectorRegistry) -> None:
        self.name, self.doc = name, doc
        self.bounds = tuple(buckets)
        self.counts = [0] * (len(self.bounds) + 1)  # the last: above every bound (+Inf)
        self.sum = 0.0
        registry.register(self)

    def observe(self, value: float) -> None:
        # le buckets: the first bound >= value
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.sum += value

    def collect(self) -> Iterator[Metric]:
        cum, rows = 0, []
        for bound, n in zip((*self.bounds, float("inf")), self.counts, strict=True):
            cum += n
            rows.append(("+Inf" if bound == float("inf") else repr(float(bound)), cum))
        yield HistogramMetricFamily(self.name, self.doc, buckets=rows, sum_value=self.sum)

    def describe(self) -> Iterator[Metric]:
        return self.collect()


class LoopCounter(Collector):
    def __init__(self, name: str, doc: str, registry: CollectorRegistry) -> None:
        self.name, self.doc = name, doc
        self.value = 0
        registry.register(self)

    def inc(self, n: int = 1) -> None:
        self.value += n

    def collect(self) -> Iterator[Metric]:
        yield CounterMetricFamily(self.name, self.doc, value=self.value)

    def describe(self) -> Iterator[Metric]:
        return self.collect()
