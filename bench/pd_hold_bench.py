"""First-token hold in 1P1D: direct producer output against forced deferral.

    python bench/pd_hold_bench.py [--model M] [--worker-arg=--flag=v ...] [--out FILE.json]

Starts a 1P1D cluster twice, the second time with ``--defer-output`` on the producer (a
flag that exists only for this comparison), and runs the same workload on both at
concurrency 1, 8 and 32. Reports, per point: first-token hold (router sent token 0 minus
producer sampled it) p50/p99, TTFT, time to second token and ITL. "Prefill alone" is the
same prompts with max_tokens=1 at concurrency 1 (the request ends at the producer), and
the producer's own prefill time (received -> token 0 sampled) at concurrency 1.
Goals: hold p50 < 2 ms on loopback; TTFT at concurrency 1 within 5% of prefill alone.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import math
import os
import sys
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from deploy.benchmark.backend import SamplingChoice  # noqa: E402
from deploy.benchmark.clusters import (
    DeviceCluster,  # noqa: E402
    Target,  # noqa: E402
)
from deploy.benchmark.grpc_backend import GrpcBackend  # noqa: E402
from deploy.benchmark.load import LoadPoint  # noqa: E402
from deploy.benchmark.report import metric  # noqa: E402
from deploy.benchmark.sweep import SweepPlan, run_points  # noqa: E402
from deploy.benchmark.workload import LengthRange, RequestSpec, random_workload  # noqa: E402
from deploy.cluster import ClusterSpec  # noqa: E402

CONFIGS = (("direct", ()), ("deferred", ("--defer-output",)))


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None)
    p.add_argument("--worker-arg", action="append", default=[])
    p.add_argument("--devices", default="", help="e.g. cuda:0,cuda:1 (producer, consumer)")
    p.add_argument("--concurrency", default="1,8,32")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--input-len", default="128:1024")
    p.add_argument("--output-len", default="16")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="bench/results/pd_hold.json")
    p.add_argument("--log-dir", default=None)
    return p.parse_args()


async def measure(address: str, label: str, plans: list[SweepPlan]) -> list[dict[str, Any]]:
    rows = []
    for plan in plans:
        res = await run_points(GrpcBackend(address), Target(label, address=address), plan, 0)
        rows += res["points"]
    return rows


def plans(args: argparse.Namespace) -> tuple[SweepPlan, SweepPlan]:
    specs = random_workload(args.num_prompts, LengthRange.parse("--input-len", args.input_len),
                            LengthRange.parse("--output-len", args.output_len),
                            LengthRange(1000, 30000), args.seed)
    warm = random_workload(2, LengthRange(64, 64), LengthRange(4, 4), LengthRange(1000, 30000),
                           args.seed + 1)
    sampling = SamplingChoice(ignore_eos=True, timeout_s=300)
    points = [LoadPoint(int(c), math.inf) for c in args.concurrency.split(",")]
    full = SweepPlan(points, specs, warm, sampling, args.seed, keep_requests=False)
    # Prefill alone: the same prompts, max_tokens=1, one at a time (16 are enough).
    alone = SweepPlan([LoadPoint(1, math.inf)], [RequestSpec(s.prompt_ids, 1) for s in specs[:16]],
                      [], sampling, args.seed, keep_requests=False)
    return full, alone


def table(doc: dict[str, Any]) -> str:
    cols = [("hold p50", "hold_ms", "p50"), ("hold p99", "hold_ms", "p99"),
            ("TTFT p50", "ttft_ms", "p50"), ("TTFT p99", "ttft_ms", "p99"),
            ("TTST p50", "ttst_ms", "p50"), ("ITL p50", "itl_ms", "p50"),
            ("ITL p99", "itl_ms", "p99"), ("prefill p50", "prefill_ms", "p50")]
    lines = ["| producer output | load | ok/failed | " + " | ".join(c for c, _, _ in cols) + " |",
             "|" + "---|" * (len(cols) + 3)]
    for cfg in doc["configs"]:
        for pt in cfg["points"]:
            m = pt["metrics"]
            vals = [metric(m, k, s) for _, k, s in cols]
            cells = ["-" if v is None else f"{v:.2f}" for v in vals]
            lines.append(f"| {cfg['label']} | {pt['label']} | {m['completed']}/{m['failed']} | "
                         + " | ".join(cells) + " |")
    for cfg in doc["configs"]:
        by = {p["label"]: p["metrics"] for p in cfg["points"]}
        ttft = metric(by["c=1"], "ttft_ms", "p50") if "c=1" in by else None
        alone = metric(by["prefill alone c=1"], "ttft_ms", "p50")
        prod = metric(by["c=1"], "prefill_ms", "p50") if "c=1" in by else None
        if ttft and alone and prod:
            lines.append(f"\n{cfg['label']}: TTFT p50 at c=1 {ttft:.2f} ms = {ttft / alone:.3f}x "
                         f"the max_tokens=1 TTFT ({alone:.2f} ms) and {ttft / prod:.3f}x the "
                         f"producer's own prefill time ({prod:.2f} ms)")
    return "\n".join(lines)


def main() -> int:
    args = parse()
    full, alone = plans(args)
    devices = tuple(d for d in args.devices.split(",") if d)
    doc: dict[str, Any] = {"command": ["python", *sys.argv], "configs": []}
    for label, producer_args in CONFIGS:
        spec = ClusterSpec(model=args.model, worker_args=tuple(args.worker_arg),
                           producer_args=producer_args)
        log_dir = os.path.join(args.log_dir, label) if args.log_dir else None
        cluster = DeviceCluster(spec, devices, log_dir=log_dir)
        cluster.start()
        try:
            rows = asyncio.run(measure(cluster.router_address, label, [full, alone]))
        finally:
            cluster.stop()
        rows[-1]["label"] = "prefill alone c=1"
        doc["configs"].append({"label": label, "target": dataclasses.asdict(spec),
                               "points": rows})
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:  # after each cluster: partial results survive
            json.dump(doc, f, indent=1)
    print(table(doc))
    return 0


if __name__ == "__main__":
    sys.exit(main())
