"""GPU: where the host time of an MoE model's long prefill goes.

bench/moe_bench.py's prefill point found the host's launch of a 4,096-token prefill nearly as
long as the whole step (V2-Lite shape: 54 of 70 ms on an H100; Qwen3-30B-A3B shape: 89 of
95 ms): either the launches are that slow or the forward syncs with the device. This runs
that prefill (moe_bench's engine and prompt) under cProfile and once under torch's CUDA
sync debug mode, and writes the top functions by own and cumulative time plus every sync
with the engine frames that asked for it.

    python3 bench/probes/moe_prefill_host_probe.py --shape v2lite --out OUT/host.txt
"""

from __future__ import annotations

import argparse
import io
import json
import os
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from bench.fresh_prefill import fresh_prompt, prefill_uncached  # noqa: E402
from bench.moe_shapes import SHAPES  # noqa: E402
from bench.probes.host_profile import profiled  # noqa: E402
from bench.probes.sync_watch import syncs_in  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), default="v2lite")
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--out", default="moe_prefill_host.txt")
    args = ap.parse_args()
    from engine.config import EngineConfig
    from engine.llm import build_engine

    cfg_dir = tempfile.mkdtemp()
    with open(os.path.join(cfg_dir, "config.json"), "w") as f:
        json.dump(SHAPES[args.shape][1], f)
    engine = build_engine(EngineConfig(
        model=cfg_dir, dtype="bfloat16", device="cuda", load_format="dummy", max_num_seqs=1,
        max_model_len=args.tokens + 8, max_num_batched_tokens=args.tokens,
        gpu_memory_utilization=0.9))

    def run() -> float:
        prompt = fresh_prompt(args.tokens)  # a prompt the prefix cache has never seen
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        prefill_uncached(engine, f"p{prompt[0]}", prompt)
        torch.cuda.synchronize()
        return (time.perf_counter() - t0) * 1e3

    for _ in range(3):
        run()
    out = io.StringIO()
    out.write(f"prefill wall ms (no profiler): {[round(run(), 2) for _ in range(3)]}\n\n")
    syncs = syncs_in(run, frames=6)
    out.write(f"==== host<->device syncs in one prefill ({len(syncs)})\n")
    out.write("\n".join(syncs[:60]) + "\n\n")
    out.write(profiled(run))
    with open(args.out, "w") as f:
        f.write(out.getvalue())
    print(out.getvalue()[:12000])


if __name__ == "__main__":
    main()
