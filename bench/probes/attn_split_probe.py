"""Decode attention's least split size against the engine's decode step: one
engine (Llama-3-8B shape, bf16, dummy weights, CUDA graphs) re-captured for each
MIN_SPLIT_TOKENS, the decode step and the attention kernel alone timed at small batches.

    python bench/probes/attn_split_probe.py --out OUT.json
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
from bench.decode_bench import LLAMA3_8B, engine_point, recapture  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--min-splits", default="256,128,64")
    ap.add_argument("--points", default="1x512,8x512,1x4096,8x4096,32x512,32x4096")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--blas", default="default", help="comma list: default,cublas,cublaslt")
    ap.add_argument("--out", default="attn_split_probe.json")
    args = ap.parse_args()
    import kernels.triton_decode_attention as dec
    from engine.config import EngineConfig
    from engine.llm import build_engine

    cfg_dir = tempfile.mkdtemp()
    with open(os.path.join(cfg_dir, "config.json"), "w") as f:
        json.dump(LLAMA3_8B, f)
    pts = [tuple(int(x) for x in p.split("x")) for p in args.points.split(",")]
    engine = build_engine(EngineConfig(
        model=cfg_dir, dtype="bfloat16", device="cuda", load_format="dummy",
        max_num_seqs=max(b for b, _ in pts), max_model_len=4096 + args.steps + 64,
        max_num_batched_tokens=2048, gpu_memory_utilization=0.85))
    out: dict = {"device": torch.cuda.get_device_name(), "runs": []}
    from bench.decode_bench import matmul_ms

    combos = [(blas, ms) for blas in args.blas.split(",")
              for ms in [int(x) for x in args.min_splits.split(",")]]
    for blas, ms in combos:
        if blas != "default":
            torch.backends.cuda.preferred_blas_library(blas)
        model = engine.runner.model
        out["runs"].append({"blas": blas, "matmul_b1_ms": round(matmul_ms(model, 1), 3),
                            "matmul_b8_ms": round(matmul_ms(model, 8), 3)})
        print(json.dumps(out["runs"][-1]), flush=True)
        dec.MIN_SPLIT_TOKENS = ms
        dec.FEW_PAIRS = 0  # every batch uses the swept size
        recapture(engine)
        for b, c in pts:
            p = engine_point(engine, b, c, args.steps)
            p["min_split_tokens"] = ms
            p["blas"] = blas
            print(json.dumps(p), flush=True)
            out["runs"].append(p)
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
