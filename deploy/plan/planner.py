"""The search over splits: every way to use N workers, simulated and ranked.

A split *keeps up* when, past the first quarter of the arrivals (warm-up), requests
complete at >= 90% of the rate they arrive (``served_ratio``); an overloaded split's queue
grows for the whole run and completes only its capacity.
Ranking: splits that keep up first, then request goodput, then SLO attainment, then
per-GPU output throughput.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from deploy.benchmark.workload import LengthRange
from deploy.plan.profile import Profile
from deploy.plan.sim_worker import EngineLimits
from deploy.plan.simulator import Arrival, Split, simulate

KEEP_UP = 0.9


@dataclass(frozen=True)
class Workload:
    rate: float  # requests per second, Poisson
    lengths: tuple[tuple[int, int], ...]  # (prompt, output) per request
    seed: int = 0

    def arrivals(self) -> list[Arrival]:
        rng = random.Random(self.seed)
        t = 0.0
        out = []
        for prompt, output in self.lengths:
            out.append(Arrival(t, prompt, output))
            t += rng.expovariate(self.rate)
        return out


def random_lengths(n: int, input_len: LengthRange, output_len: LengthRange,
                   seed: int) -> tuple[tuple[int, int], ...]:
    rng = random.Random(seed)
    return tuple((input_len.draw(rng), output_len.draw(rng)) for _ in range(n))


@dataclass(frozen=True)
class Slos:
    ttft_ms: float
    tpot_ms: float
    attainment: float = 0.9  # the share of requests that must meet both to count as met

    def as_goodput(self) -> dict[str, float]:
        return {"ttft": self.ttft_ms, "tpot": self.tpot_ms}


def splits(n: int) -> list[Split]:
    """Colocated N, every xPyD with x + y = N, and every mix of a P/D part and colocated."""
    if n < 1:
        raise ValueError(f"--gpus: must be >= 1, got {n}")
    out = [Split(0, 0, n)]
    for pd in range(2, n + 1):
        for x in range(1, pd):
            out.append(Split(x, pd - x, n - pd))
    return out


def _p(m: dict[str, Any], key: str, p: str) -> float | None:
    v = m[key][p]
    return None if v is None else round(float(v), 3)


def candidate(split: Split, m: dict[str, Any], rate: float, slos: Slos) -> dict[str, Any]:
    attained = m["good_requests"] / m["requests"] if m["requests"] else 0.0
    keeps_up = m["served_ratio"] >= KEEP_UP
    return {"producers": split.producers, "consumers": split.consumers,
            "colocated": split.colocated, "split": split.label(),
            "goodput_rps": round(m["request_goodput"], 4),
            "throughput_rps": round(m["request_throughput"], 4),
            "slo_attainment": round(attained, 4), "keeps_up": keeps_up,
            "served_ratio": round(m["served_ratio"], 4),
            "meets_slos": keeps_up and attained >= slos.attainment,
            "ttft_p50_ms": _p(m, "ttft_ms", "p50"), "ttft_p90_ms": _p(m, "ttft_ms", "p90"),
            "tpot_p50_ms": _p(m, "tpot_ms", "p50"), "tpot_p90_ms": _p(m, "tpot_ms", "p90"),
            "output_tps_per_gpu": round(m["output_throughput_per_gpu"] or 0.0, 3),
            "completed": m["completed"], "failed": m["failed"]}


def rank_key(c: dict[str, Any]) -> tuple[Any, ...]:
    return (not c["keeps_up"], -c["goodput_rps"], -c["slo_attainment"],
            -c["output_tps_per_gpu"], c["producers"] + c["consumers"])


def plan(profile: Profile, gpus: int, workload: Workload, slos: Slos,
         limits: EngineLimits | None = None, policy: str = "round_robin") -> dict[str, Any]:
    """``{"best": ..., "candidates": [...], "over_capacity": bool}``, best first."""
    arrivals = workload.arrivals()
    # every split, whatever the worker's attention data-parallel layout: a producer's and
    # a consumer's groups pair rank to rank as colocated workers' groups serve
    cands = [candidate(s, simulate(profile, s, arrivals, limits, policy, slos.as_goodput(),
                                   workload.seed), workload.rate, slos)
             for s in splits(gpus)]
    cands.sort(key=rank_key)
    return {"gpus": gpus, "rate": workload.rate, "best": cands[0], "candidates": cands,
            "over_capacity": not any(c["keeps_up"] for c in cands)}


def fewest_gpus(profile: Profile, max_gpus: int, workload: Workload, slos: Slos,
                limits: EngineLimits | None = None,
                policy: str = "round_robin") -> dict[str, Any]:
    """The plan for the fewest workers whose best split meets the SLOs at the rate; the
    plan for ``max_gpus`` (with ``"met": False``) when none does."""
    if max_gpus < 1:
        raise ValueError(f"--max-gpus: must be >= 1, got {max_gpus}")
    result: dict[str, Any] = {}
    for n in range(1, max_gpus + 1):
        result = plan(profile, n, workload, slos, limits, policy)
        if result["best"]["meets_slos"]:
            return {**result, "met": True}
    return {**result, "met": False}


def _slurm_model(model: str) -> str:
    return "" if model in ("", "smollm2") else f" PDSERVE_MODEL={model}"


def launch_lines(best: dict[str, Any], model: str, policy: str,
                 profile: Profile | None = None) -> list[str]:
    """profile: the worker layout to repeat when it is not one group of one rank."""
    x, y, z = best["producers"], best["consumers"], best["colocated"]
    m = "" if model in ("", "smollm2") else f" --model {model}"
    if profile is not None and profile.dp_size > 1:
        m += (f" --tensor-parallel-size {profile.tp_size} "
              f"--data-parallel-size {profile.dp_size}")
    return [f"pdserve launch --producers {x} --consumers {y} --colocated {z}{m} "
            f"--policy {policy}",
            # one worker per node, so the job needs a node per worker plus the router's
            f"SLURM: PDSERVE_PRODUCER_NODES={x} PDSERVE_CONSUMER_NODES={y} "
            f"PDSERVE_COLOCATED_NODES={z} PDSERVE_WORKERS_PER_NODE=1{_slurm_model(model)} "
            f"sbatch --nodes={1 + x + y + z} deploy/slurm/pdserve.sbatch",
            f'config: {{"producers": {x}, "consumers": {y}, "colocated": {z}, '
            f'"policy": "{policy}"}}']


def table(cands: Sequence[dict[str, Any]]) -> str:
    head = (f"{'#':>3} {'split':<10} {'goodput/s':>9} {'SLO %':>6} {'keeps up':>8} "
            f"{'TTFT p50':>9} {'p90':>9} {'TPOT p50':>9} {'p90':>8} {'tok/s/GPU':>9}")
    rows = [head]

    def f(v: float | None, w: int) -> str:
        return f"{v:>{w}.1f}" if v is not None else f"{'-':>{w}}"

    for i, c in enumerate(cands, 1):
        rows.append(f"{i:>3} {c['split']:<10} {c['goodput_rps']:>9.3f} "
                    f"{100 * c['slo_attainment']:>6.1f} {'yes' if c['keeps_up'] else 'NO':>8} "
                    f"{f(c['ttft_p50_ms'], 9)} {f(c['ttft_p90_ms'], 9)} "
                    f"{f(c['tpot_p50_ms'], 9)} {f(c['tpot_p90_ms'], 8)} "
                    f"{c['output_tps_per_gpu']:>9.1f}")
    return "\n".join(rows)
