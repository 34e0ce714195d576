"""Aggregate metrics of one benchmark point, defined as ``vllm bench serve`` defines them.

* Only successful requests enter latencies and throughputs; failed ones are counted and
  their errors listed, never dropped silently.
* TTFT: send -> first token-bearing message. E2E: send -> end of the stream.
* TPOT (per request): (E2E - TTFT) / (output tokens - 1); requests with one output token
  have no TPOT (they are left out of its distribution, and pass a TPOT goodput SLO).
* ITL: the gaps between consecutive token-bearing messages, pooled over all requests.
* Throughputs divide by the wall time of the point (first send to last end).
* Goodput: successful requests that meet every SLO given, per second.
* Percentiles use numpy's linear interpolation, like vLLM.
Additions for P/D: time to second token, first-token hold and KV transfer time (server
timing), the producer's prefill time (received -> token 0 sampled), and the first gap's
handoff (token 0 sent -> KV ready, in its parts, -> the first decode step).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from deploy.benchmark.record import KV_READY_PARTS, RequestRecord

DEFAULT_PERCENTILES = (50.0, 90.0, 99.0)
SLO_KEYS = ("ttft", "tpot", "e2el")  # the metrics --goodput may bound (ms), as in vLLM


@dataclass(frozen=True)
class PointContext:
    duration_s: float  # wall time of the point: first send to last end
    workers: int = 0  # producers + consumers + colocated (0: unknown)
    gpus: int = 0  # accelerators the workers use (0: unknown / CPU)


def parse_goodput(items: Sequence[str]) -> dict[str, float]:
    """``["ttft:500", "tpot:50"]`` -> {"ttft": 500.0, "tpot": 50.0} (milliseconds)."""
    slos: dict[str, float] = {}
    for item in items:
        key, sep, value = item.partition(":")
        if not sep or key not in SLO_KEYS:
            raise ValueError(f"--goodput: expected KEY:MS with KEY in {SLO_KEYS}, got {item!r}")
        try:
            ms = float(value)
        except ValueError:
            raise ValueError(f"--goodput: {item!r}: {value!r} is not a number") from None
        if ms <= 0:
            raise ValueError(f"--goodput: {item!r}: the SLO must be > 0 ms")
        slos[key] = ms
    return slos


def distribution(values_ms: Sequence[float],
                 percentiles: Sequence[float] = DEFAULT_PERCENTILES) -> dict[str, Any]:
    """count, mean, std and the percentiles (keys p50, p90, ...); None values when empty."""
    out: dict[str, Any] = {"count": len(values_ms)}
    arr = np.asarray(values_ms, dtype=np.float64)
    out["mean"] = float(arr.mean()) if arr.size else None
    out["std"] = float(arr.std()) if arr.size else None
    for p in percentiles:
        out[f"p{p:g}"] = float(np.percentile(arr, p)) if arr.size else None
    return out


def meets_slos(rec: RequestRecord, slos: dict[str, float]) -> bool:
    values = {"ttft": rec.ttft, "tpot": rec.tpot or 0.0, "e2el": rec.e2el}
    for key, limit_ms in slos.items():
        v = values[key]
        if v is None or v * 1e3 > limit_ms:
            return False
    return True


def _ms(values: Sequence[float | None]) -> list[float]:
    return [v * 1e3 for v in values if v is not None]


def summarize(records: Sequence[RequestRecord], ctx: PointContext,
              slos: dict[str, float] | None = None,
              percentiles: Sequence[float] = DEFAULT_PERCENTILES) -> dict[str, Any]:
    ok = [r for r in records if r.success]
    failed = [r for r in records if not r.success]
    dur = ctx.duration_s
    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(r.prompt_len for r in ok)

    def rate(x: float) -> float:
        return x / dur if dur > 0 else 0.0

    m: dict[str, Any] = {
        "requests": len(records), "completed": len(ok), "failed": len(failed),
        "errors": dict(Counter(r.error for r in failed).most_common()),
        "duration_s": dur, "total_input_tokens": in_tokens, "total_output_tokens": out_tokens,
        "request_throughput": rate(len(ok)), "output_throughput": rate(out_tokens),
        "total_token_throughput": rate(in_tokens + out_tokens),
        "workers": ctx.workers, "gpus": ctx.gpus,
    }
    # Per worker counts producers and consumers together: the hardware the cluster costs.
    for unit, n in (("worker", ctx.workers), ("gpu", ctx.gpus)):
        m[f"output_throughput_per_{unit}"] = m["output_throughput"] / n if n else None
        m[f"request_throughput_per_{unit}"] = m["request_throughput"] / n if n else None
    if slos:
        good = sum(meets_slos(r, slos) for r in ok)
        m["goodput_slos_ms"] = dict(slos)
        m["good_requests"] = good
        m["request_goodput"] = rate(good)
    cached, ideal = sum(r.cached_tokens for r in ok), sum(r.ideal_cached for r in ok)
    # the prefix cache: hits reported by the workers against the workload's ideal (an
    # infinite cache); of_ideal is the share of the ideal achieved
    m["prefix_cache"] = {"cached_tokens": cached, "ideal_cached_tokens": ideal,
                         "hit_rate": cached / in_tokens if in_tokens else 0.0,
                         "ideal_hit_rate": ideal / in_tokens if in_tokens else 0.0,
                         "of_ideal": cached / ideal if ideal else None}
    itls = [g for r in ok for g in r.itl]
    series = {"ttft_ms": _ms([r.ttft for r in ok]), "tpot_ms": _ms([r.tpot for r in ok]),
              "itl_ms": _ms(itls), "e2el_ms": _ms([r.e2el for r in ok]),
              "ttst_ms": _ms([r.ttst for r in ok]),
              "hold_ms": [r.hold_ms for r in ok if r.hold_ms is not None],
              "hold_producer_ms": [r.hold_producer_ms for r in ok
                                   if r.hold_producer_ms is not None],
              "hold_engine_ms": [r.hold_engine_ms for r in ok if r.hold_engine_ms is not None],
              "hold_writer_ms": [r.hold_writer_ms for r in ok if r.hold_writer_ms is not None],
              "hold_wire_ms": [r.hold_wire_ms for r in ok if r.hold_wire_ms is not None],
              "hold_router_ms": [r.hold_router_ms for r in ok if r.hold_router_ms is not None],
              "kv_transfer_ms": [r.kv_transfer_ms for r in ok if r.kv_transfer_ms is not None],
              "prefill_ms": [r.prefill_ms for r in ok if r.prefill_ms is not None],
              "kv_ready_ms": [r.kv_ready_ms for r in ok if r.kv_ready_ms is not None],
              "first_step_wait_ms": [r.first_step_wait_ms for r in ok
                                     if r.first_step_wait_ms is not None],
              **{name: [v for r in ok if (v := getattr(r, name)) is not None]
                 for name in (*KV_READY_PARTS, "dest_after_token0_ms")}}
    for name, values in series.items():
        m[name] = distribution(values, percentiles)
    return m
