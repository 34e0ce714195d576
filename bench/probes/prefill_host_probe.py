"""GPU: where the host time of a short prefill after a cached prefix goes.

The producer's time to token 0 for a 128-token question after a cached 2,048-token
prefix is 20-30 ms wall on one H200 while its kernels take ~10.6 ms (bench/prefix_step_bench.py
profile): the eager step is host-bound. This probe runs that step (same engine and workload
as prefix_step_bench) under cProfile, and once under torch's CUDA sync debug mode, and
writes the top functions by own and cumulative time plus every host<->device sync with the
engine frames that asked for it.

    PYTHONPATH=. python3 bench/probes/prefill_host_probe.py --out $OUT/prefill_host.txt
"""

from __future__ import annotations

import argparse
import io
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from bench.prefix_step_bench import (  # noqa: E402
    PREFIX,
    QUESTION,
    _token0_ms,
    _tokens,
    producer_engine,
)
from bench.probes.host_profile import profiled  # noqa: E402
from bench.probes.sync_watch import syncs_in  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="prefill_host.txt")
    args = ap.parse_args()
    engine = producer_engine()
    gen = torch.Generator().manual_seed(0)
    prefix = _tokens(PREFIX, gen)
    n = [0]

    def run() -> float:
        n[0] += 1
        return _token0_ms(engine, f"r{n[0]}", prefix + _tokens(QUESTION, gen))

    for _ in range(6):
        run()
    walls = [run() for _ in range(5)]
    out = io.StringIO()
    out.write(f"cached-prefix token 0, wall ms (no profiler): {walls}\n\n")
    out.write(profiled(run))
    syncs = syncs_in(run)
    out.write(f"\n==== host<->device syncs in one cached step ({len(syncs)})\n")
    for line in syncs:
        out.write(line + "\n")
    with open(args.out, "w") as f:
        f.write(out.getvalue())
    print(out.getvalue()[:6000])


if __name__ == "__main__":
    main()
