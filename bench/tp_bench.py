"""Tensor parallelism on the GPU: a Llama-3-8B-shaped model (bf16, dummy weights)
on TP1 and TP2 in one run: the decode step at a few batch sizes and a 4k-token prefill, and
the all-reduce's share of each TP2 step.

    python bench/tp_bench.py --out bench/results/tp_h200.json          (2 GPUs)
    python bench/tp_bench.py --device cpu --preset tiny --batches 1,4 --prefill 256 \\
        --context 64 --steps 3 --out /tmp/tp_cpu.json                  (CPU dry run, gloo)

Each run says whether the engine replayed CUDA graphs for decode (``cuda_graphs``): without
them, a step includes the Python cost of issuing every kernel.

A decode step is one ``engine.step()`` over ``batch`` requests of ``context`` tokens whose KV
is in place (wall time, host scheduling and sampling included); prefill is the one step that
runs a ``prefill``-token prompt (one chunk) and samples token 0, best of 2 after a warm-up.

The all-reduce's share: after the engines are closed, the same step's collectives (see
bench/tp_collectives.py: 1 + 2 per layer all-reduces of [tokens, hidden], the LM head's
gather, and the sampled-id broadcast where rows sample eagerly: not in graphed decode)
run alone on the same GPUs, captured in one CUDA graph
per rank where possible. ``allreduce_ms`` is one such pass, ``allreduce_share`` its
fraction of the TP step measured above; ``lm_head_ms`` is the gather and broadcast alone.
The goals: TP2 decode at batch 1 <= 0.65x TP1's, 4k prefill on TP2 <= 0.6x TP1's.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import signal
import sys
import tempfile
import time
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.tp_collectives import step_collectives, time_collectives  # noqa: E402
from deploy.benchmark.dummy_model import write_dummy_model  # noqa: E402

GOALS = {"decode_b1_ms": 0.65, "prefill_ms": 0.6}  # TP2 / TP1 at most: the targets


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def decode_ms(engine: Any, device: str, batch: int, context: int, steps: int) -> float:
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
    sync(device)
    t0 = time.perf_counter()
    for _ in range(steps):
        engine.step()
    sync(device)
    ms = (time.perf_counter() - t0) / steps * 1e3
    for rid in ids:
        engine.abort(rid)
    while engine.has_unfinished():
        engine.step()
    return ms


def prefill_ms(engine: Any, device: str, tokens: int, reps: int) -> float:
    from engine.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=1, ignore_eos=True)
    times = []
    for r in range(reps + 1):  # the first one compiles and warms up
        engine.add_request(f"p{r}", [1 + (r + j) % 1000 for j in range(tokens)], params)
        sync(device)
        t0 = time.perf_counter()
        engine.step()
        sync(device)
        times.append((time.perf_counter() - t0) * 1e3)
        while engine.has_unfinished():
            engine.step()
    return min(times[1:])


def uses_graphs(engine: Any) -> bool:
    g = getattr(engine.runner, "graphs", None)
    return bool(g is not None and g.use_graphs)


def run_tp(args: argparse.Namespace, model_dir: str, tp: int, batches: list[int]) -> dict:
    from engine.config import EngineConfig
    from engine.llm import build_engine

    t0 = time.perf_counter()
    engine = build_engine(EngineConfig(
        model=model_dir, dtype=args.dtype, device=args.device, load_format="dummy",
        max_num_seqs=max(batches), max_model_len=max(args.prefill, args.context) + 64,
        max_num_batched_tokens=args.prefill, kv_cache_bytes=args.kv_cache_mib << 20,
        tensor_parallel_size=tp))
    run: dict = {"tp": tp, "cuda_graphs": uses_graphs(engine),
                 "build_s": round(time.perf_counter() - t0, 1)}
    try:
        for b in batches:
            run[f"decode_b{b}_ms"] = round(decode_ms(engine, args.device, b, args.context,
                                                     args.steps), 3)
            print(f"tp{tp} decode b{b}: {run[f'decode_b{b}_ms']} ms", flush=True)
        run["prefill_ms"] = round(prefill_ms(engine, args.device, args.prefill, 2), 2)
        print(f"tp{tp} prefill {args.prefill}: {run['prefill_ms']} ms", flush=True)
    finally:
        engine.runner.close()
        del engine
        gc.collect()
        if args.device.startswith("cuda"):
            torch.cuda.empty_cache()
    return run


def collective_share(run: dict, model_cfg: dict, args: argparse.Namespace,
                     batches: list[int]) -> dict:
    """The step's collectives alone on run["tp"] ranks, per decode batch and the prefill."""
    tp = run["tp"]
    # (tokens, sampled rows, broadcast): decode rows sample in the graphs' head (default
    # sampling is temperature alone), so rank 0 broadcasts no ids there
    points = {f"decode_b{b}": (b, b, False) for b in batches}
    points["prefill"] = (args.prefill, 1, True)
    plans = {}
    for name, (tokens, sampled, bcast) in points.items():
        plans[name] = step_collectives(model_cfg, tp, tokens, sampled, args.dtype, bcast)
        plans[f"{name}_head"] = [op for op in plans[name] if op.kind != "all_reduce"]
    # bounded well inside tp_gpu.sh's step budget: a rank that hangs costs the share, not the run
    timed = time_collectives(plans, tp, args.device, iters=args.collective_iters, timeout_s=90)
    out = {}
    for name in points:
        t, head = timed[name], timed[f"{name}_head"]
        step = run[f"{name}_ms"]
        out[name] = {"allreduce_ms": t["ms"], "allreduce_share": round(t["ms"] / step, 3),
                     "lm_head_ms": head["ms"], "cuda_graph": t["graph"],
                     "collectives": t["ops"], "mib": t["mib"]}
        print(f"tp{tp} {name}: collectives {t['ms']:.3f} ms = {out[name]['allreduce_share']:.1%}"
              f" of the {step} ms step (graph: {t['graph']})", flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tps", default="1,2")
    ap.add_argument("--batches", default="1,32,128")
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--prefill", type=int, default=4096)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--preset", default="llama3-8b", help="deploy.benchmark.dummy_model shape")
    ap.add_argument("--device", default="cuda", help="cuda (ranks on cuda:0..) or cpu")
    ap.add_argument("--dtype", default=None, help="default: bfloat16 on cuda, float32 on cpu")
    ap.add_argument("--kv-cache-mib", type=int, default=16384, help="per rank")
    ap.add_argument("--collective-iters", type=int, default=20)
    ap.add_argument("--out", default="bench/results/tp_h200.json")
    args = ap.parse_args()
    # a SIGTERM (tp_gpu.sh's step timeout) unwinds through the finally blocks that stop
    # the follower ranks and the collective processes
    signal.signal(signal.SIGTERM, _terminated)
    if args.dtype is None:
        args.dtype = "bfloat16" if args.device.startswith("cuda") else "float32"
    batches = [int(b) for b in args.batches.split(",") if b]
    tps = [int(t) for t in args.tps.split(",") if t]
    model_dir = write_dummy_model(os.path.join(tempfile.mkdtemp(), "model"), args.preset)
    with open(os.path.join(model_dir, "config.json")) as f:
        model_cfg = json.load(f)
    cuda = args.device.startswith("cuda")
    result: dict = {"device": torch.cuda.get_device_name() if cuda else "cpu",
                    "gpus": torch.cuda.device_count() if cuda else 0,
                    "model": f"{args.preset} shape, dummy weights", "dtype": args.dtype,
                    "context": args.context, "prefill_tokens": args.prefill,
                    "torch": torch.__version__, "command": " ".join(sys.argv),
                    "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "runs": []}
    for tp in tps:
        result["runs"].append(run_tp(args, model_dir, tp, batches))
        print(json.dumps(result["runs"][-1]), flush=True)
        save(result, args.out)  # what is measured survives a later step's timeout
    base = next((r for r in result["runs"] if r["tp"] == 1), None)
    for run in result["runs"]:
        if base is None or run is base:
            continue
        run["vs_tp1"] = {k: round(v / base[k], 3) for k, v in run.items()
                         if k.endswith("_ms") and k in base}
        run["goals"] = {k: {"goal": g, "ratio": run["vs_tp1"][k],
                            "met": run["vs_tp1"][k] <= g}
                        for k, g in GOALS.items() if k in run["vs_tp1"]}
    save(result, args.out)
    for run in result["runs"]:
        if run["tp"] > 1:
            try:
                run["collectives"] = collective_share(run, model_cfg, args, batches)
            except RuntimeError as e:  # the step numbers still stand; say why this is missing
                run["collectives_error"] = str(e)[-2000:]
                print(f"tp{run['tp']} collectives failed: {e}", flush=True)
    save(result, args.out)
    print(json.dumps(result, indent=1))


def save(result: dict, path: str) -> None:
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        json.dump(result, f, indent=1)


def _terminated(signum: int, frame: Any) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a second one must not cut the clean-up
    raise SystemExit(f"terminated by signal {signum}")


if __name__ == "__main__":
    main()
