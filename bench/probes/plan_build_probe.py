"""CPU: the host time of ModelRunner._plan, the step description built before a step's
first kernel, for prefill chunks of several sizes and a batch of decode rows (best of 30).

    python bench/probes/plan_build_probe.py
"""

from __future__ import annotations

import os
import sys
import time
from types import SimpleNamespace

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from engine.model_runner import ModelRunner  # noqa: E402
from engine.request import Request  # noqa: E402
from engine.sampling_params import SamplingParams  # noqa: E402
from engine.scheduler import ScheduledChunk  # noqa: E402

BLOCK = 16


def chunks_for(n_req: int, length: int) -> list[ScheduledChunk]:
    """n_req requests whose whole prompt of `length` tokens is this step's chunk; length 1:
    decode rows (the token after a 128-token prompt)."""
    out = []
    for i in range(n_req):
        prompt = list(range(1, max(length, 128) + 1))
        r = Request(f"r{i}", prompt, SamplingParams(), seed=0)
        r.block_ids = list(range(i * 1000, i * 1000 + -(-(len(prompt) + 1) // BLOCK)))
        start = 0 if length > 1 else len(prompt) - 1
        out.append(ScheduledChunk(r, start, length, True))
    return out


def main() -> None:
    runner = SimpleNamespace(block_size=BLOCK)
    for n_req, length in ((1, 4096), (2, 1024), (16, 128), (256, 1)):
        chunks = chunks_for(n_req, length)
        best = float("inf")
        for _ in range(30):
            t0 = time.perf_counter()
            ModelRunner._plan(runner, chunks, {})  # type: ignore[arg-type]
            best = min(best, time.perf_counter() - t0)
        print(f"{n_req} x {length}: {best * 1e3:.3f} ms")


if __name__ == "__main__":
    main()
