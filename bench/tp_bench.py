"""Tensor parallelism on the GPU (issue 16): a Llama-3-8B-shaped model (bf16, dummy weights)
on TP1 and TP2 in one run: the decode step at a few batch sizes and a 4k-token prefill.

    python bench/tp_bench.py --out bench/results/tp_h200.json

TP1 runs as users get it (CUDA graphs for decode); TP2 runs eagerly (graphs are not yet
captured under TP), so its number includes the Python cost of issuing every kernel.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.decode_bench import LLAMA3_8B  # noqa: E402


def decode_ms(engine, batch: int, context: int, steps: int) -> float:
    from engine.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=steps + 8, ignore_eos=True)
    ids = []
    for i in range(batch):
        blocks = engine.reserve(context)
        assert blocks is not None, "KV pool too small"
        rid = f"d{batch}-{i}"
        engine.add_prefilled(rid, [1 + (i + j) % 1000 for j in range(context)], params,
                             blocks, first_token=2)
        ids.append(rid)
    for _ in range(3):
        engine.step()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(steps):
        engine.step()
    torch.cuda.synchronize()
    ms = (time.perf_counter() - t0) / steps * 1e3
    for rid in ids:
        engine.abort(rid)
    while engine.has_unfinished():
        engine.step()
    return ms


def prefill_ms(engine, tokens: int, reps: int) -> float:
    from engine.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=1, ignore_eos=True)
    times = []
    for r in range(reps + 1):  # the first one compiles and warms up
        engine.add_request(f"p{r}", [1 + (r + j) % 1000 for j in range(tokens)], params)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        engine.step()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e3)
        while engine.has_unfinished():
            engine.step()
    return min(times[1:])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tps", default="1,2")
    ap.add_argument("--batches", default="1,32")
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--prefill", type=int, default=4096)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--out", default="bench/results/tp_h200.json")
    args = ap.parse_args()
    from engine.config import EngineConfig
    from engine.llm import build_engine

    batches = [int(b) for b in args.batches.split(",") if b]
    cfg_dir = tempfile.mkdtemp()
    with open(os.path.join(cfg_dir, "config.json"), "w") as f:
        json.dump(LLAMA3_8B, f)
    result: dict = {"device": torch.cuda.get_device_name(), "gpus": torch.cuda.device_count(),
                    "model": "Llama-3-8B shape, dummy", "dtype": "bfloat16",
                    "torch": torch.__version__, "command": " ".join(sys.argv),
                    "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "runs": []}
    for tp in [int(t) for t in args.tps.split(",") if t]:
        t0 = time.perf_counter()
        engine = build_engine(EngineConfig(
            model=cfg_dir, dtype="bfloat16", device="cuda", load_format="dummy",
            max_num_seqs=max(batches), max_model_len=max(args.prefill, args.context) + 64,
            max_num_batched_tokens=args.prefill, kv_cache_bytes=8 << 30,
            tensor_parallel_size=tp))
        run: dict = {"tp": tp, "cuda_graphs": engine.runner.graphs is not None
                     and engine.runner.graphs.use_graphs,
                     "build_s": round(time.perf_counter() - t0, 1)}
        for b in batches:
            run[f"decode_b{b}_ms"] = round(decode_ms(engine, b, args.context, args.steps), 3)
            print(tp, b, run[f"decode_b{b}_ms"], flush=True)
        run[f"prefill_{args.prefill}_ms"] = round(prefill_ms(engine, args.prefill, 2), 2)
        print(json.dumps(run), flush=True)
        result["runs"].append(run)
        engine.runner.close()
        del engine
        gc.collect()
        torch.cuda.empty_cache()
    base = result["runs"][0]
    for run in result["runs"][1:]:
        run["vs_tp1"] = {k: round(v / base[k], 3) for k, v in run.items()
                         if k.endswith("_ms") and k in base}
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
