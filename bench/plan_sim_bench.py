"""How fast the planner's simulator runs: a 64-worker cluster, 10 minutes of traffic.

    python bench/plan_sim_bench.py [--workers 64] [--minutes 10] [--rate R] [--out f.json]

The profile is hand-made with an H100-class shape (prefill 8 ms + 0.05 ms/token; decode
8 ms + 0.1 ms/sequence, growing with context; 400k KV tokens a worker; 25 GB/s between
workers), the split 16P48D, prompts 512-2048 tokens, outputs 64-512. Reference measured in
the same run: a fixed pure-Python loop (``calibrate``), so a contended CPU shows as a slow
reference rather than a slow simulator.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from deploy.plan.profile import Profile  # noqa: E402
from deploy.plan.sim_worker import EngineLimits  # noqa: E402
from deploy.plan.simulator import Arrival, Split, simulate  # noqa: E402


def gpu_profile() -> Profile:
    tokens = [16, 256, 1024, 4096, 8192]
    batch = [1, 16, 64, 256]
    ctx = [256, 2048, 8192]
    return Profile.from_json({
        "version": 1, "model": "hand-made-8b", "device": "h100-like", "block_size": 16,
        "prefill": {"tokens": tokens, "ms": [8 + 0.05 * t for t in tokens]},
        "decode": {"batch": batch, "context": ctx,
                   "ms": [[8 + 0.1 * b * (1 + c / 4096) for c in ctx] for b in batch]},
        "kv_capacity_tokens": 400_000, "kv_bytes_per_token": 131_072, "transfer_GBps": 25.0})


def calibrate() -> float:
    """Seconds for a fixed pure-Python workload (the same every run)."""
    t0 = time.perf_counter()
    acc = 0
    for i in range(3_000_000):
        acc += i % 7
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--workers", type=int, default=64)
    ap.add_argument("--minutes", type=float, default=10.0)
    ap.add_argument("--rate", type=float, default=0.0, help="default: 2.5 requests/s a worker")
    ap.add_argument("--out", default="")
    a = ap.parse_args()
    rate = a.rate or 2.5 * a.workers
    producers = a.workers // 4
    split = Split(producers, a.workers - producers, 0)
    rng = random.Random(0)
    t, arrivals = 0.0, []
    while t < a.minutes * 60:
        arrivals.append(Arrival(t, rng.randint(512, 2048), rng.randint(64, 512)))
        t += rng.expovariate(rate)
    ref = calibrate()
    t0, c0 = time.perf_counter(), time.process_time()
    m = simulate(gpu_profile(), split, arrivals, EngineLimits(256, 8192),
                 slos={"ttft": 2000, "tpot": 100})
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    row = {"workers": a.workers, "split": split.label(), "traffic_s": a.minutes * 60,
           "requests": len(arrivals), "output_tokens": m["total_output_tokens"],
           "wall_s": round(wall, 2), "cpu_s": round(cpu, 2), "calibrate_s": round(ref, 3),
           "completed": m["completed"], "ttft_p50_ms": m["ttft_ms"]["p50"],
           "tpot_p50_ms": m["tpot_ms"]["p50"], "goodput_rps": m["request_goodput"],
           "machine": f"{platform.node()} {os.cpu_count()} cpus", "date": time.ctime()}
    print(json.dumps(row, indent=1))
    if a.out:
        with open(a.out, "w", encoding="utf-8") as f:
            json.dump(row, f, indent=1)


if __name__ == "__main__":
    main()
