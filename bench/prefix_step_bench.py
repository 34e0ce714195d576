"""GPU: the engine's time to token 0 for a prompt whose prefix is cached, against the same
prompt uncached, with prefill attention's key split on and off, and where the step's GPU
time goes.

One producer engine (direct output, as a P/D producer runs; prefix caching on, 2,048-token
step budget as bench/prefix_cache_gpu.sh gives it) on one GPU, Llama-3-8B shape, bf16,
dummy weights. A prompt is a 2,048-token shared prefix + a new 128-token question:
  * cached: the prefix's blocks are in the cache, so one 128-token chunk runs;
  * full: a new prefix every time, so 2,048 + 128 tokens run (two chunks at this budget).
Each is timed from add_request to token 0 (``LLMEngine.step`` until the output), median of
--reps, with the short prefill step replayed as a CUDA graph and, in the same engine, run
eagerly under three launch choices of prefill attention:
  * graphs: the 128-token chunk (cached) and the last 128-token chunk (full) replay a
    prefill graph (engine/prefill_graphs.py; the launcher's defaults, fixed grid);
  * auto: eager, the launcher's split-K and short-chunk tiles (kernels/triton_prefill_split.py);
  * unsplit: eager, no key split (MAX_SPLITS = 1), short-chunk tiles;
  * before: eager, no split and the long-chunk tiles (256 queries, 8 warps) for every step.
For the cached prompt it also records a torch.profiler summary of one request (CUDA time
per kernel name, top 12, and the total) under graphs, auto and before.
--prefill-graphs on / off runs only the first / the three eager variants (off builds the
engine without prefill graphs).

    PYTHONPATH=. python3 bench/prefix_step_bench.py --out $OUT/prefix_step.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.decode_bench import LLAMA3_8B  # noqa: E402

PREFIX, QUESTION = 2048, 128


def _tokens(n: int, gen: torch.Generator) -> list[int]:
    return torch.randint(1000, 120000, (n,), generator=gen).tolist()


def _token0_ms(engine: Any, rid: str, prompt: list[int]) -> float:
    """add_request to token 0, in ms; the request is released after."""
    from engine.sampling_params import SamplingParams

    torch.cuda.synchronize()
    t0 = time.perf_counter()
    engine.add_request(rid, prompt, SamplingParams(max_tokens=1, ignore_eos=True))
    while True:
        res = engine.step()
        if any(o.request_id == rid and o.new_token_ids for o in res.outputs):
            break
    ms = (time.perf_counter() - t0) * 1e3
    engine.release(rid)
    return ms


def _variant(name: str) -> None:
    """Sets prefill attention's launch choices for `name` (module globals the launcher
    reads at every call)."""
    import kernels.triton_prefill_attention as tpa
    import kernels.triton_prefill_split as tps

    tps.MAX_SPLITS = 1 if name in ("unsplit", "before") else 16
    tpa.SHORT_BLOCK_M = 0 if name == "before" else 128


def producer_engine(prefill_graph_max_tokens: int = 256) -> Any:
    """The producer engine this bench times: Llama-3-8B shape, dummy weights, bf16, prefix
    caching on, the 2,048-token step budget bench/prefix_cache_gpu.sh gives it."""
    from engine.config import EngineConfig
    from engine.llm import build_engine

    cfg_dir = tempfile.mkdtemp()
    with open(os.path.join(cfg_dir, "config.json"), "w") as f:
        json.dump(LLAMA3_8B, f)
    return build_engine(EngineConfig(
        model=cfg_dir, dtype="bfloat16", device="cuda", load_format="dummy", role="producer",
        max_num_seqs=8, max_model_len=4096, max_num_batched_tokens=2048,
        kv_cache_bytes=8 << 30, prefill_graph_max_tokens=prefill_graph_max_tokens))


def _profile(engine: Any, rid: str, prompt: list[int]) -> dict:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        wall = _token0_ms(engine, rid, prompt)
    rows = []
    total = 0.0
    for e in prof.key_averages():
        us = getattr(e, "self_device_time_total", None)
        if us is None:
            us = getattr(e, "self_cuda_time_total", 0.0)
        if us <= 0:
            continue
        total += us
        rows.append({"name": e.key[:120], "cuda_ms": us / 1e3, "calls": e.count})
    rows.sort(key=lambda r: -r["cuda_ms"])
    return {"wall_ms_profiled": wall, "cuda_ms_total": total / 1e3, "top": rows[:12]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--out", default="prefix_step.json")
    ap.add_argument("--prefill-graphs", choices=("both", "on", "off"), default="both",
                    help="time the graphed variant, the eager ones, or both (one engine)")
    args = ap.parse_args()
    engine = producer_engine(0 if args.prefill_graphs == "off" else 256)
    graphs = engine.runner.prefill_graphs
    if args.prefill_graphs != "off" and (graphs is None or not graphs.use_graphs):
        raise SystemExit("prefill graphs were not captured (no CUDA graphs on this engine)")
    gen = torch.Generator().manual_seed(0)
    prefix = _tokens(PREFIX, gen)
    n = 0

    def rid() -> str:
        nonlocal n
        n += 1
        return f"r{n}"

    result: dict[str, Any] = {
        "device": torch.cuda.get_device_name(), "model": "Llama-3-8B shape, dummy, bf16",
        "torch": torch.__version__, "prefix": PREFIX, "question": QUESTION,
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "variants": {}}
    if graphs is not None:
        result["prefill_graphs"] = {"buckets": graphs.buckets, "capture_s": graphs.capture_s,
                                    "pool_mib": graphs.pool_bytes / 2**20}
    _token0_ms(engine, rid(), prefix + _tokens(QUESTION, gen))  # caches the prefix
    names = {"both": ("graphs", "auto", "unsplit", "before"), "on": ("graphs",),
             "off": ("auto", "unsplit", "before")}[args.prefill_graphs]
    for name in names:
        if name != "graphs":
            engine.runner.prefill_graphs = None  # every later step runs eagerly
            _variant(name)  # read at every eager launch (a graph keeps what it captured)
        for _ in range(3):  # compiles this variant's kernels for both shapes
            _token0_ms(engine, rid(), prefix + _tokens(QUESTION, gen))
            _token0_ms(engine, rid(), _tokens(PREFIX + QUESTION, gen))
        replays = graphs.num_replays if graphs is not None else 0
        cached = [_token0_ms(engine, rid(), prefix + _tokens(QUESTION, gen))
                  for _ in range(args.reps)]
        full = [_token0_ms(engine, rid(), _tokens(PREFIX + QUESTION, gen))
                for _ in range(args.reps)]
        v: dict[str, Any] = {"cached_ms": statistics.median(cached),
                             "full_ms": statistics.median(full),
                             "cached_all": cached, "full_all": full}
        if name == "graphs":  # one per request: the cached chunk, or the full one's last
            assert graphs is not None
            v["graph_replays"] = graphs.num_replays - replays
            assert v["graph_replays"] == 2 * args.reps, v["graph_replays"]
        if name in ("graphs", "auto", "before"):
            v["profile_cached"] = _profile(engine, rid(), prefix + _tokens(QUESTION, gen))
        result["variants"][name] = v
        print(f"{name}: cached {v['cached_ms']:.2f} ms, full {v['full_ms']:.2f} ms",
              flush=True)
    var = result["variants"]
    if "auto" in var:
        a, b = var["auto"], var["before"]
        result["cached_speedup_auto_vs_before"] = b["cached_ms"] / a["cached_ms"]
        result["full_over_cached_auto"] = a["full_ms"] / a["cached_ms"]
    if "graphs" in var:
        result["full_over_cached_graphs"] = var["graphs"]["full_ms"] / var["graphs"]["cached_ms"]
    if "graphs" in var and "auto" in var:
        result["cached_speedup_graphs_vs_auto"] = (var["auto"]["cached_ms"]
                                                   / var["graphs"]["cached_ms"])
    stats = engine.prefix_cache_stats()
    result["prefix_cache"] = {"queried_tokens": stats.queried_tokens,
                              "hit_tokens": stats.hit_tokens}
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(json.dumps({k: v for k, v in result.items() if k != "variants"}, indent=1))


if __name__ == "__main__":
    main()
