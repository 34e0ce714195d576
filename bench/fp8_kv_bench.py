"""FP8 KV cache on one GPU: decode attention time and KV capacity, bf16 KV against
float8_e4m3fn KV (--kv-cache-dtype fp8), measured in the same run.

1. Decode attention (kernels/triton_decode_attention.py, the launcher's defaults, as the
   engine runs it) over a block-major pool of Llama-3-8B's shape (32 layers, 8 KV heads of
   128, block 16; fewer layers where a point's pool would not fit), every layer once per
   CUDA-graph replay; per layer ms, next to the byte floor (the KV bytes a step reads /
   the measured HBM read rate). Points: batch x context, every request at full context.
   ``--fp8-tiles`` also times other KV tiles for the float8 pool, and ``--sweep`` a grid of
   them within ``--budget-s`` a point, nearest the defaults first (tuning aids).
2. KV capacity: the engine (Llama-3-8B shape, dummy weights) built with the same
   --gpu-memory-utilization once per KV dtype, each in a process of its own (so the first
   engine's memory cannot shrink the second's budget): its pool's tokens and bytes, and
   its decode step (CUDA graphs) at ``--engine-points``.

    python bench/fp8_kv_bench.py --out $OUT/fp8_kv_h200.json

Targets: fp8 attention <= 0.6x bf16 at batch >= 32, context >= 4k; capacity 2x.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # moe_variants' own imports
from bench.decode_bench import LLAMA3_8B, engine_point, graph_time_ms, hbm_read_tbps  # noqa: E402
from bench.moe_variants import settings  # noqa: E402

LAYERS, HKV, HQ, D, BS = 32, 8, 32, 128, 16
DTYPES = {"bf16": torch.bfloat16, "fp8": torch.float8_e4m3fn}
POOL_LIMIT_BYTES = 60 << 30  # the largest pool a point allocates (one dtype at a time)


def fill_pool(nb: int, layers: int, dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    """[NB, L, 2, BS, Hkv, D] of N(0, 1) values stored in ``dtype`` (a layer at a time: the
    float32 draw of a whole pool would not fit)."""
    pool = torch.empty(nb, layers, 2, BS, HKV, D, dtype=dtype, device="cuda")
    for i in range(layers):
        pool[:, i] = torch.randn(nb, 2, BS, HKV, D, device="cuda", generator=gen).to(dtype)
    return pool


Tile = tuple[int, ...]  # block_n, num_warps[, num_stages[, programs_per_sm]]
TILE_KEYS = ("block_n", "num_warps", "num_stages", "programs_per_sm")


def sweep_tiles() -> list[Tile]:
    """The float8 sweep's grid, nearest the launcher's float8 defaults first (a budget cut
    keeps the likeliest)."""
    from kernels import triton_decode_attention as tda

    base = (tda.FP8_BLOCK_N, tda.FP8_NUM_WARPS, tda.FP8_NUM_STAGES, tda.FP8_PROGRAMS_PER_SM)
    grid: list[Tile] = [(bn, w, st, pps) for bn in (32, 64, 128) for w in (1, 2, 4, 8)
            for st in (1, 2, 3, 4) for pps in (8, 16, 32)]

    def dist(t: Tile) -> int:
        return sum(a != b for a, b in zip(t, base, strict=True))
    return sorted(grid, key=dist)[1:]  # the defaults themselves are always timed


def variant_rounds(step: Callable[[], None], layers: int, variants: list[str],
                   rounds: int = 2) -> dict[str, list[float]]:
    """The float8 pool's default tiles under the tree's settings and each variant's
    ('module.NAME=value' joined by ','), per layer ms, rounds alternating so that drift shows
    as spread, not as a difference."""
    times: dict[str, list[float]] = {}
    for _ in range(rounds):
        for v in ["", *variants]:
            with settings(v):
                times.setdefault(v or "defaults", []).append(
                    round(graph_time_ms(step) / layers, 4))
    return times


def attention_point(batch: int, context: int, fp8_tiles: list[Tile],
                    hbm: float, budget_s: float = 0.0, variants: list[str] | None = None) -> dict:
    """hbm: the measured HBM read rate, bytes/s (the floors' denominator)."""
    from kernels.triton_decode_attention import decode_attention

    blocks = batch * -(-context // BS)
    per_layer_bf16 = blocks * 2 * BS * HKV * D * 2
    layers = max(1, min(LAYERS, POOL_LIMIT_BYTES // per_layer_bf16))
    gen = torch.Generator(device="cuda").manual_seed(0)
    tables = torch.randperm(blocks, device="cuda", generator=gen).view(batch, -1).to(torch.int32)
    lens = torch.full((batch,), context, dtype=torch.int32, device="cuda")
    q = torch.randn(batch, HQ, D, device="cuda", generator=gen).to(torch.bfloat16)
    out = torch.empty_like(q)
    scale = D ** -0.5
    point: dict = {"batch": batch, "context": context, "layers_timed": layers}
    for name, dtype in DTYPES.items():
        pool = fill_pool(blocks, layers, dtype, gen)
        views = [pool[:, i] for i in range(layers)]
        tiles: list = [None] + (fp8_tiles if name == "fp8" else [])
        t_end = time.monotonic() + budget_s
        for tile in tiles:
            if tile is not None and budget_s and time.monotonic() > t_end:
                point["fp8_sweep_cut"] = True  # the rest of the grid was not timed
                break
            kw = {} if tile is None else dict(zip(TILE_KEYS, tile, strict=False))

            # no max_seq_len: the splits are sized as in the engine's decode graphs
            def step(kw: dict = kw, views: list = views) -> None:
                for kv in views:
                    decode_attention(q, kv, tables, lens, scale, out=out, **kw)

            try:
                ms = graph_time_ms(step) / layers
            except Exception as e:  # a variant that does not compile is skipped, named
                point.setdefault("fp8_failed", []).append([list(tile or ()), repr(e)[:200]])
                continue
            if tile is None:
                point[f"{name}_attention_ms"] = round(ms, 4)
            else:
                point.setdefault("fp8_tiles", []).append(
                    {**dict(zip(TILE_KEYS, tile, strict=False)), "ms": round(ms, 4)})
        if name == "fp8" and variants:
            def defaults_step(views: list = views) -> None:
                for kv in views:
                    decode_attention(q, kv, tables, lens, scale, out=out)

            runs = variant_rounds(defaults_step, layers, variants)
            base = min(runs["defaults"])
            point["fp8_variants"] = {
                v: {"ms": ms, "best_over_defaults": round(min(ms) / base, 3),
                    "best_over_bf16": round(min(ms) / point["bf16_attention_ms"], 3)}
                for v, ms in runs.items()}
        nbytes = batch * context * 2 * HKV * D * pool.element_size()
        point[f"{name}_floor_ms"] = round(nbytes / hbm * 1e3, 4)
        point[f"{name}_kv_bytes_per_layer"] = nbytes
        del pool, views
        gc.collect()
        torch.cuda.empty_cache()
    point["fp8_over_bf16"] = round(point["fp8_attention_ms"] / point["bf16_attention_ms"], 3)
    if point.get("fp8_tiles"):
        best = min(point["fp8_tiles"], key=lambda t: t["ms"])
        point["fp8_best_tile"] = {**best, "over_bf16": round(best["ms"]
                                                             / point["bf16_attention_ms"], 3)}
    return point


def engine_capacity(cfg_dir: str, kv_dtype: str, util: float, points: list[tuple[int, int]],
                    steps: int) -> dict:
    from engine.config import EngineConfig
    from engine.llm import build_engine

    engine = build_engine(EngineConfig(
        model=cfg_dir, dtype="bfloat16", device="cuda", load_format="dummy",
        kv_cache_dtype=kv_dtype, max_num_seqs=max([b for b, _ in points] + [1]),
        max_model_len=8192, max_num_batched_tokens=2048, gpu_memory_utilization=util))
    lay = engine.layout
    res: dict = {"kv_cache_dtype": kv_dtype, "pool_dtype": lay.dtype,
                 "pool_bytes": engine.kv_cache.nbytes, "num_blocks": lay.num_blocks,
                 "tokens": lay.num_blocks * lay.block_size,
                 "bytes_per_token": lay.block_nbytes // lay.block_size, "steps": []}
    for b, c in points:
        res["steps"].append(engine_point(engine, b, c, steps))
    engine.runner.close()
    return res


def engine_in_child(args: argparse.Namespace, kv_dtype: str) -> dict:
    """engine_capacity in a fresh process: its last stdout line is the result."""
    cmd = [sys.executable, os.path.abspath(__file__), "--engine-child", kv_dtype,
           "--gpu-memory-utilization", str(args.gpu_memory_utilization),
           "--engine-points", args.engine_points, "--steps", str(args.steps)]
    run = subprocess.run(cmd, check=True, stdout=subprocess.PIPE, text=True)
    res: dict = json.loads(run.stdout.strip().splitlines()[-1])
    print(json.dumps(res), flush=True)
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--points", default="32x4096,64x4096,32x8192,128x4096",
                    help="batch x context of the attention comparison")
    ap.add_argument("--fp8-tiles", default="",
                    help="block_n:num_warps[:num_stages[:programs_per_sm]] of KV tiles also "
                         "timed for the float8 pool (the launcher's defaults always are)")
    ap.add_argument("--variants", default="",
                    help="'module.NAME=value[,...]' settings separated by ';': the float8 "
                         "pool's default tiles timed under each, alternating with the defaults")
    ap.add_argument("--sweep", action="store_true",
                    help="also time the float8 tile grid (sweep_tiles), --budget-s a point")
    ap.add_argument("--budget-s", type=float, default=60.0)
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    ap.add_argument("--engine-points", default="32x4096",
                    help="batch x context of the engines' decode steps ('' for none)")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--no-engine", action="store_true", help="attention points only")
    ap.add_argument("--engine-child", choices=("auto", "fp8"), default=None,
                    help=argparse.SUPPRESS)  # one engine's capacity, as a JSON line
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."),
                                                  "fp8_kv_h200.json"))
    args = ap.parse_args()
    if args.engine_child is not None:
        cfg_dir = tempfile.mkdtemp()
        with open(os.path.join(cfg_dir, "config.json"), "w") as f:
            json.dump(LLAMA3_8B, f)
        eng = [tuple(int(x) for x in p.split("x")) for p in args.engine_points.split(",") if p]
        print(json.dumps(engine_capacity(cfg_dir, args.engine_child,
                                         args.gpu_memory_utilization, eng, args.steps)))
        return
    pts = [tuple(int(x) for x in p.split("x")) for p in args.points.split(",") if p]
    tiles: list[Tile] = [tuple(int(x) for x in t.split(":")) for t in args.fp8_tiles.split(",")
                         if t]
    if args.sweep:
        tiles += [t for t in sweep_tiles() if t not in tiles]
    out: dict = {"command": "python " + shlex.join(sys.argv), "device":
                 torch.cuda.get_device_name(), "torch": torch.__version__,
                 "shape": {"layers": LAYERS, "num_heads": HQ, "num_kv_heads": HKV,
                           "head_dim": D, "block_size": BS, "q_dtype": "bfloat16"},
                 "attention": []}
    hbm = hbm_read_tbps()
    out["hbm_read_tbps"] = round(hbm, 3)

    def save() -> None:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)

    for b, c in pts:
        p = attention_point(b, c, tiles, hbm * 1e12, args.budget_s if args.sweep else 0.0,
                            [v for v in args.variants.split(";") if v])
        print(json.dumps(p), flush=True)
        out["attention"].append(p)
        save()
    big = [p for p in out["attention"] if p["batch"] >= 32 and p["context"] >= 4096]
    out["attention_target"] = {"fp8_over_bf16_max": 0.6,
                               "worst": max((p["fp8_over_bf16"] for p in big), default=None)}
    if not args.no_engine:
        gc.collect()
        torch.cuda.empty_cache()  # what this process holds, it holds for both children
        caps = {d: engine_in_child(args, d) for d in ("auto", "fp8")}
        out["capacity"] = {"gpu_memory_utilization": args.gpu_memory_utilization,
                           "bf16": caps["auto"], "fp8": caps["fp8"],
                           "fp8_over_bf16_tokens": round(caps["fp8"]["tokens"]
                                                         / caps["auto"]["tokens"], 4),
                           "target": 2.0}
        print(json.dumps({k: v for k, v in out["capacity"].items()
                          if k not in ("bf16", "fp8")}), flush=True)
    save()


if __name__ == "__main__":
    main()
