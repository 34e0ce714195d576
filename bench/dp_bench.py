"""Data-parallel attention against tensor parallelism: decode tokens/s per GPU of a
DeepSeek-V2-Lite-shaped model (bf16, dummy weights) served by one engine of two ranks, as
DPA-TP2 (--tensor-parallel-size 2 --data-parallel-size 2: each rank its own requests and
latent KV, the MoE layers expert-parallel over both) and as TP2 (heads and experts split,
every rank every request), at B = 64..256 requests per rank.

    python bench/dp_bench.py --out $OUT/dp_bench.json                     (2 GPUs)
    python bench/dp_bench.py --share-gpu --out $OUT/dp_bench_1gpu.json    (1 GPU, 2 processes)
    python bench/dp_bench.py --device cpu --preset tiny --batches 2,4 --context 32 \\
        --steps 3 --out /tmp/dp_cpu.json                                  (CPU dry run, gloo)

The same requests per GPU in both layouts: B per rank means 2B requests in the engine,
spread evenly over DPA's two groups, all of them in TP2's one batch. A step is one
``engine.step()`` of the engine in its serving mode (deferred output: the step's wall time
includes scheduling, sampling and the read of the previous step), timed over ``--steps``
steps after every request has been prefilled and a few warm-up steps; tokens/s per GPU =
2B / step time / 2. The layouts differ in more than attention: the DPA engine runs its
steps eagerly (``cuda_graphs`` false), TP2 replays CUDA graphs, so ``tp2_eager`` is TP2
eager, the like-for-like comparison. ``kv_tokens_per_gpu``: what each layout's latent KV
costs, per request token, per GPU (TP2 replicates the latent on both ranks).

--share-gpu: both ranks on one GPU (NCCL refuses two ranks on one device, so the
collectives go through host memory over gloo, and neither layout replays graphs): this
checks that the layouts run on a one-GPU machine; its tokens/s are not per-GPU numbers.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from moe_shapes import DEEPSEEK_V2_LITE  # noqa: E402

from engine.config import EngineConfig  # noqa: E402
from engine.llm import build_engine  # noqa: E402
from engine.llm_engine import LLMEngine  # noqa: E402
from engine.sampling_params import SamplingParams  # noqa: E402

V2_LITE: dict[str, Any] = DEEPSEEK_V2_LITE  # the shape moe_bench measures
# the same family at CPU size: a dry run of every code path in seconds
TINY = {**V2_LITE, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 3,
        "num_attention_heads": 4, "num_key_value_heads": 4, "vocab_size": 512,
        "kv_lora_rank": 32, "qk_nope_head_dim": 16, "qk_rope_head_dim": 16,
        "v_head_dim": 16, "n_routed_experts": 8, "num_experts_per_tok": 2,
        "moe_intermediate_size": 32, "max_position_embeddings": 4096,
        "rope_scaling": None, "bos_token_id": 1, "eos_token_id": 2}
PRESETS = {"v2lite": V2_LITE, "tiny": TINY}
LAYOUTS = {"dpa_tp2": dict(data_parallel_size=2), "tp2": {},
           "tp2_eager": dict(enforce_eager=True)}


def write_model(root: str, preset: str) -> str:
    path = os.path.join(root, preset)
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(PRESETS[preset], f)
    return path


def _sync(engine: LLMEngine) -> None:
    if engine.device.type == "cuda":
        torch.cuda.synchronize(engine.device)


def decode_point(engine: LLMEngine, per_rank: int, context: int, steps: int,
                 warmup: int = 3) -> dict[str, Any]:
    """2 * per_rank requests of ``context`` prompt tokens, prefilled, then ``steps`` timed
    decode steps of all of them."""
    n = 2 * per_rank
    dp = engine.config.data_parallel_size
    vocab = engine.model_cfg.vocab_size
    params = SamplingParams(max_tokens=steps + warmup + 8, ignore_eos=True, temperature=0)
    ids = [f"b{per_rank}-{i}" for i in range(n)]
    for i, rid in enumerate(ids):
        prompt = [3 + (i * 7 + j) % (vocab - 3) for j in range(context)]
        engine.add_request(rid, prompt, params, dp_rank=i % dp if dp > 1 else None)
    while any(engine.requests[r].num_computed_tokens < context for r in ids):
        engine.step()
    for _ in range(warmup):
        engine.step()
    _sync(engine)
    t0 = time.perf_counter()
    for _ in range(steps):
        engine.step()
    _sync(engine)
    step_s = (time.perf_counter() - t0) / steps
    running = sum(1 for r in ids if r in engine.requests and not engine.requests[r].finished)
    for rid in ids:
        engine.abort(rid)
    while engine.has_unfinished():
        engine.step()
    if running != n:
        raise RuntimeError(f"batch {n}: only {running} requests were still decoding")
    return {"per_rank": per_rank, "requests": n, "step_ms": step_s * 1e3,
            "tokens_per_s_per_gpu": n / step_s / 2}


def run_layout(name: str, path: str, args: argparse.Namespace) -> dict[str, Any]:
    most = max(args.batches)
    dp = LAYOUTS[name].get("data_parallel_size", 1)
    bs = 16
    # one group's pool: its share of the largest point, prompt + every step, plus slack
    per_group = 2 * most // dp
    blocks = per_group * -(-(args.context + args.steps + 16) // bs) + 16
    extra: dict[str, Any] = {}
    if args.share_gpu:
        extra["tp_host_staged"] = True
    cfg = EngineConfig(
        model=path, load_format="dummy", device=args.device,
        dtype="float32" if args.device == "cpu" else "bfloat16", block_size=bs,
        num_kv_blocks=blocks, max_model_len=args.context + args.steps + 32,
        max_num_seqs=per_group, max_num_batched_tokens=args.prefill_budget,
        tensor_parallel_size=2, tp_timeout_s=600.0,
        devices=("cuda:0", "cuda:0") if args.share_gpu else None,
        enforce_eager=bool(LAYOUTS[name].get("enforce_eager")) or args.share_gpu,
        extra=extra, **{k: v for k, v in LAYOUTS[name].items() if k != "enforce_eager"})
    t0 = time.perf_counter()
    engine = build_engine(cfg)
    try:
        load_s = time.perf_counter() - t0
        graphs = engine.runner.graphs is not None and engine.runner.graphs.use_graphs
        points = []
        for b in args.batches:
            try:
                p = decode_point(engine, b, args.context, args.steps)
            except Exception as e:  # keep the other points; the error is the result
                print(f"{name:>9} B/rank {b:>4}: {e!r}", flush=True)
                points.append({"per_rank": b, "error": repr(e)[:300]})
                break  # the engine may still hold this point's requests
            print(f"{name:>9} B/rank {b:>4}: {p['step_ms']:8.2f} ms/step  "
                  f"{p['tokens_per_s_per_gpu']:10.1f} tok/s/GPU", flush=True)
            points.append(p)
        layout = engine.layout
        per_token = layout.block_nbytes // layout.block_size
        return {"layout": name, "cuda_graphs": bool(graphs), "load_s": load_s,
                "kv_bytes_per_token_per_rank": per_token,
                # DPA: a request's latent on one rank; TP2: on both
                "kv_tokens_per_gpu": per_token * (1 if dp > 1 else 2) / 2,
                "points": points}
    finally:
        engine.runner.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="JSON results file")
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--preset", default="v2lite", choices=sorted(PRESETS))
    ap.add_argument("--batches", default="64,128,256", help="requests per rank")
    ap.add_argument("--context", type=int, default=512, help="prompt tokens per request")
    ap.add_argument("--steps", type=int, default=20, help="timed decode steps per point")
    ap.add_argument("--prefill-budget", type=int, default=8192,
                    help="--max-num-batched-tokens while the batch prefills")
    ap.add_argument("--layouts", default=None,
                    help="default dpa_tp2,tp2,tp2_eager (--share-gpu: dpa_tp2,tp2_eager, "
                         "since no layout replays graphs there)")
    ap.add_argument("--share-gpu", action="store_true",
                    help="both ranks on one GPU (host-staged collectives, no graphs)")
    args = ap.parse_args()
    args.batches = [int(x) for x in args.batches.split(",")]
    layouts = args.layouts or ("dpa_tp2,tp2_eager" if args.share_gpu
                               else "dpa_tp2,tp2,tp2_eager")
    names = [x for x in layouts.split(",") if x]
    bad = [x for x in names if x not in LAYOUTS]
    if bad:
        ap.error(f"--layouts: unknown {bad}; choose from {sorted(LAYOUTS)}")
    if args.device.startswith("cuda") and not args.share_gpu and torch.cuda.device_count() < 2:
        ap.error("two CUDA devices are needed (or --share-gpu on one)")
    with tempfile.TemporaryDirectory() as root:
        path = write_model(root, args.preset)
        runs = [run_layout(n, path, args) for n in names]
    result = {
        "command": "python " + " ".join(sys.argv), "preset": args.preset,
        "device": (torch.cuda.get_device_name(0) if args.device.startswith("cuda")
                   else "cpu"),
        "share_gpu": args.share_gpu, "context": args.context, "steps": args.steps,
        "runs": runs}
    by = {r["layout"]: {p["per_rank"]: p for p in r["points"] if "error" not in p}
          for r in runs}
    if "dpa_tp2" in by:
        for ref in ("tp2", "tp2_eager"):
            if ref in by:
                result[f"dpa_over_{ref}"] = {
                    str(b): by["dpa_tp2"][b]["tokens_per_s_per_gpu"]
                    / by[ref][b]["tokens_per_s_per_gpu"] for b in args.batches
                    if b in by["dpa_tp2"] and b in by[ref]}
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(json.dumps({k: v for k, v in result.items() if k.startswith("dpa_over")}))


if __name__ == "__main__":
    main()
