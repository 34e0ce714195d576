"""GPU: does a producer's step hand the host back while it runs (LLMEngine.device_wait)?

A producer reads each step at once; its worker loop takes the router's commands during the
step only if the engine gets to ask the step's event before the step is done. A hidden
host<->device sync inside the launch (a pageable copy, an .item()) would end the step
before the first look, and every command would wait for the step's end. For each step
shape the serving path runs (one short prompt through a prefill graph, several through the
eager path, long prompts), this prints the looks per step, the host time to the launch's
return and to the step's end, and every sync torch's debug mode sees in one such step.

    PYTHONPATH=. python3 bench/probes/device_wait_probe.py --out $OUT/device_wait.txt
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from bench.prefix_step_bench import producer_engine  # noqa: E402
from bench.probes.sync_watch import syncs_in  # noqa: E402
from engine.request_state import RequestState  # noqa: E402
from engine.sampling_params import SamplingParams  # noqa: E402

SHAPES = {"1 x 128 (prefill graph)": (1, 128), "4 x 128 (eager)": (4, 128),
          "1 x 1024": (1, 1024), "2 x 1024": (2, 1024)}


def _steps(engine: Any, n: int, length: int, tag: str, gen: torch.Generator) -> list[dict]:
    rids = [f"{tag}-{i}" for i in range(n)]
    for rid in rids:
        prompt = torch.randint(10, 30_000, (length,), generator=gen).tolist()
        engine.add_request(rid, prompt, SamplingParams(max_tokens=16))
    rows = []
    runner = engine.runner
    real = runner.execute
    marks: dict[str, float] = {}

    def execute(*a: Any, **kw: Any) -> Any:
        out = real(*a, **kw)
        marks["launched"] = time.perf_counter()
        return out

    runner.execute = execute
    looks = [0]

    def look(left_s: float) -> None:
        looks[0] += 1
        time.sleep(50e-6)

    engine.device_wait = look
    try:
        while any(engine.state_of(r) != RequestState.TRANSFERRING for r in rids):
            looks[0] = 0
            t0 = time.perf_counter()
            engine.step()
            t1 = time.perf_counter()
            rows.append(dict(looks=looks[0], launch_ms=1e3 * (marks["launched"] - t0),
                             step_ms=1e3 * (t1 - t0)))
    finally:
        runner.execute = real
        engine.device_wait = None
        for rid in rids:
            engine.release(rid)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="device_wait.txt")
    args = ap.parse_args()
    engine = producer_engine()
    gen = torch.Generator().manual_seed(0)
    lines = []
    for name, (n, length) in SHAPES.items():
        _steps(engine, n, length, f"warm{name}", gen)
        rows = _steps(engine, n, length, f"r{name}", gen)
        lines.append(f"{name}: " + "; ".join(
            f"looks {r['looks']}, launch returned {r['launch_ms']:.2f} ms, "
            f"step {r['step_ms']:.2f} ms"
            for r in rows))
    for name, (n, length) in SHAPES.items():
        syncs = syncs_in(lambda n=n, length=length, name=name: _steps(
            engine, n, length, f"sync{name}", gen), frames=5)
        lines.append(f"\n==== {name}: host<->device syncs ({len(syncs)})")
        lines += syncs[:40]
    text = "\n".join(lines) + "\n"
    with open(args.out, "w") as f:
        f.write(text)
    print(text[:8000])


if __name__ == "__main__":
    main()
