"""Where a graphed decode step's GPU time goes: kernel time by name, one H200.

Builds the decode bench's Llama-3-8B-shaped engine, runs timed steps at each batch under
the torch profiler, and prints per-kernel totals per step plus the host time of the
step's parts, so the gap to bench/decode_bench.py's reference can be attributed.

    python bench/decode_profile.py --batches 1,128 --context 512
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.decode_bench import LLAMA3_8B  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", default="1,128")
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--max-num-seqs", type=int, default=256)
    args = ap.parse_args()
    from torch.profiler import ProfilerActivity, profile

    from engine.config import EngineConfig
    from engine.llm import build_engine
    from engine.sampling_params import SamplingParams

    cfg_dir = tempfile.mkdtemp()
    with open(os.path.join(cfg_dir, "config.json"), "w") as f:
        json.dump(LLAMA3_8B, f)
    engine = build_engine(EngineConfig(
        model=cfg_dir, dtype="bfloat16", device="cuda", load_format="dummy",
        max_num_seqs=args.max_num_seqs, max_model_len=4096 + 30 + 64,
        max_num_batched_tokens=2048, gpu_memory_utilization=0.85))
    for batch in [int(b) for b in args.batches.split(",")]:
        params = SamplingParams(max_tokens=args.steps * 3 + 20, ignore_eos=True)
        ids = []
        for i in range(batch):
            blocks = engine.reserve(args.context)
            rid = f"p{batch}-{i}"
            engine.add_prefilled(rid, [1 + (i + j) % 1000 for j in range(args.context)],
                                 params, blocks, first_token=2)
            ids.append(rid)
        for _ in range(3):
            engine.step()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(args.steps):
            engine.step()
        torch.cuda.synchronize()
        wall = (time.perf_counter() - t0) / args.steps * 1e3
        # host time of the runner's launch alone (execute returns before the GPU finishes)
        host = []
        orig = engine.runner.execute

        def timed(*a, orig=orig, host=host, **k):
            s = time.perf_counter()
            r = orig(*a, **k)
            host.append(time.perf_counter() - s)
            return r

        engine.runner.execute = timed
        with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
            for _ in range(args.steps):
                engine.step()
            torch.cuda.synchronize()
        engine.runner.execute = orig
        kern: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0])
        for e in prof.events():
            if e.device_type == torch.autograd.DeviceType.CUDA:
                k = kern[e.name[:90]]
                k[0] += e.device_time_total
                k[1] += 1
        total = sum(v[0] for v in kern.values()) / args.steps / 1e3
        print(f"== batch {batch} ctx {args.context}: step {wall:.3f} ms wall, "
              f"GPU kernels {total:.3f} ms/step, execute() host "
              f"{sum(host) / len(host) * 1e3:.3f} ms/step", flush=True)
        for name, (us, n) in sorted(kern.items(), key=lambda kv: -kv[1][0])[:25]:
            print(f"  {us / args.steps / 1e3:8.4f} ms  {n / args.steps:6.1f}/step  {name}")
        for rid in ids:
            engine.abort(rid)
        while engine.has_unfinished():
            engine.step()


if __name__ == "__main__":
    main()
