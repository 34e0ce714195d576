"""Two fusions for the small-batch decode step, measured on one GPU:

* decode attention's split merge done by the last split program (FUSED_MERGE) instead of a
  second kernel;
* o_proj and down_proj as K-split batched GEMMs whose float32 partials the next RMSNorm
  sums (engine/models/split_k.py), instead of cuBLAS's split-K with its own reduce kernel.

Part 1 times the projections alone (32 layers in one CUDA graph, Llama-3-8B shapes): F.linear
+ RMSNorm against the batched partials + the partial-summing RMSNorm, per row count and
K chunk. Part 2 re-captures one engine's decode graphs per setting and times its decode step
as bench/decode_bench.py does.

    python bench/probes/fusion_probe.py --out OUT.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)
from bench.decode_bench import LLAMA3_8B, engine_point, graph_time_ms, recapture  # noqa: E402

SHAPES = {"o_proj": (4096, 4096), "down_proj": (14336, 4096)}  # (K, N)


def projection_ms(k: int, n: int, rows: int, chunk: int | None) -> float:
    """32 x (projection + residual RMSNorm) in one graph; chunk None: F.linear."""
    from kernels.triton_norm import rms_norm

    ws = [torch.randn(n, k, dtype=torch.bfloat16, device="cuda") * 0.02 for _ in range(32)]
    x = torch.randn(rows, k, dtype=torch.bfloat16, device="cuda")
    res = torch.randn(rows, n, dtype=torch.bfloat16, device="cuda")
    nw = torch.ones(n, dtype=torch.bfloat16, device="cuda")

    def step() -> None:
        for w in ws:
            if chunk is None:
                y = torch.nn.functional.linear(x, w)
            else:
                s = k // chunk
                y = torch.bmm(x.view(rows, s, chunk).transpose(0, 1),
                              w.view(n, s, chunk).permute(1, 2, 0), out_dtype=torch.float32)
            rms_norm(y, nw, 1e-5, res)

    return graph_time_ms(step)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--points", default="1x512,2x512,4x512,8x512,1x4096,32x512")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--out", default="fusion_probe.json")
    ap.add_argument("--no-projections", action="store_true", help="the engine part only")
    ap.add_argument("--repeats", type=int, default=1, help="timed windows per point (median)")
    ap.add_argument("--configs", default="neither,merge,merge + split_k 2,merge + split_k 4",
                    help="comma list of the engine settings below")
    args = ap.parse_args()
    out: dict = {"device": torch.cuda.get_device_name(), "projections": [], "engine": []}
    for name, (k, n) in ({} if args.no_projections else SHAPES).items():
        for rows in (1, 2, 4, 8):
            row = {"proj": name, "rows": rows, "linear_ms": round(projection_ms(k, n, rows,
                                                                                None), 3)}
            for chunk in (512, 1024, 2048, k // 4, k // 2):
                if k % chunk == 0:
                    row[f"split_{k // chunk}_ms"] = round(projection_ms(k, n, rows, chunk), 3)
            print(json.dumps(row), flush=True)
            out["projections"].append(row)

    import engine.models.split_k as sk
    import kernels.triton_decode_attention as dec
    from engine.config import EngineConfig
    from engine.llm import build_engine

    cfg_dir = tempfile.mkdtemp()
    with open(os.path.join(cfg_dir, "config.json"), "w") as f:
        json.dump(LLAMA3_8B, f)
    pts = [tuple(int(x) for x in p.split("x")) for p in args.points.split(",")]
    engine = build_engine(EngineConfig(
        model=cfg_dir, dtype="bfloat16", device="cuda", load_format="dummy",
        max_num_seqs=max(b for b, _ in pts), max_model_len=4096 + args.steps * args.repeats + 64,
        max_num_batched_tokens=2048, gpu_memory_utilization=0.85))
    # (name, FUSED_MAX_SPLITS, split_k MAX_ROWS, SPLITS, split_k QKV, FEW_PAIRS_MAX_SPLITS)
    fm = dec.FUSED_MAX_SPLITS
    configs = {"neither": (0, 0, 2, False, 0), "merge": (fm, 0, 2, False, 0),
               "merge + split_k 2": (fm, 4, 2, False, 0),
               "merge + split_k 4": (fm, 4, 4, False, 0),
               "merge + split_k 2 + qkv": (fm, 4, 2, True, 0),
               "merge + split_k 2 + few-pairs cap 32": (fm, 4, 2, False, 32),
               "merge + split_k 2 + qkv + cap 32": (fm, 4, 2, True, 32)}
    for name in args.configs.split(","):
        (dec.FUSED_MAX_SPLITS, sk.MAX_ROWS, sk.SPLITS, sk.QKV,
         dec.FEW_PAIRS_MAX_SPLITS) = configs[name]
        recapture(engine)
        for b, c in pts:
            p = engine_point(engine, b, c, args.steps, args.repeats)
            p["config"] = name
            print(json.dumps(p), flush=True)
            out["engine"].append(p)
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
