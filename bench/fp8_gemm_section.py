"""bench/fp8_bench.py's ``gemm`` section: Llama-3-8B's four FP8 projections alone at
decode-batch rows, cuBLAS's row-wise scaled mm (also with its operands swapped) against the
K-split Triton kernel, each call timed inside a CUDA graph.

    python3 bench/fp8_bench.py --sections gemm --gemm-rows 64,128,256 --quantization fp8-all
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from typing import Any

import torch


def gemm_section(args: argparse.Namespace, ctx: dict[str, Any]) -> list[dict[str, Any]]:
    """Llama-3-8B's four projections alone at --gemm-rows rows: cuBLAS's row-wise scaled mm
    against the K-split Triton kernel (kernels/triton_fp8_split_gemm, its partials as the
    reader gets them, and its [M, N] product when unsplit), each over enough weight copies
    that L2 holds none between calls, against the weight bytes' floor at the run's HBM rate."""
    import kernels.triton_fp8_gemm as tg
    from kernels.triton_fp8_gemm import fp8_gemm
    from kernels.triton_fp8_split_gemm import auto_splits, fp8_split_gemm

    def swapped(xq: torch.Tensor, xs: torch.Tensor, w: torch.Tensor, sc: torch.Tensor,
                out_dtype: torch.dtype) -> torch.Tensor:
        """The same product with the weight as cuBLAS's A operand: out^T [N, M]. cuBLAS
        tiles the N x M output, so at few rows its tile choice (and SM count) differs."""
        return torch._scaled_mm(w, xq.t(), scale_a=sc, scale_b=xs.reshape(1, -1),
                                out_dtype=out_dtype, use_fast_accum=tg.FAST_ACCUM)

    def swapped_back(xq: torch.Tensor, xs: torch.Tensor, w: torch.Tensor, sc: torch.Tensor,
                     out_dtype: torch.dtype) -> torch.Tensor:
        return swapped(xq, xs, w, sc, out_dtype).t().contiguous()

    dev = torch.device("cuda")
    shapes = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096),
              "down": (4096, 14336)}
    out = []

    def timed(fn: Callable[..., Any], ws: list[torch.Tensor], *rest: Any) -> float:
        """ms per fn(xq, xs, w, sc, ...) call, cycling through the weight copies ws, the
        calls captured in one CUDA graph (launched from Python they are launch-bound: a
        first run this way timed cuBLAS's qkv at 34 µs against a 6 µs weight floor)."""
        reps = 40
        for i in range(3):
            fn(*rest[:2], ws[i % len(ws)], *rest[2:])
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for i in range(reps):
                fn(*rest[:2], ws[i % len(ws)], *rest[2:])
        g.replay()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(3):
            g.replay()
        b.record()
        b.synchronize()
        return a.elapsed_time(b) / (3 * reps)

    for name, (n, k) in shapes.items():
        copies = max(2, -(-256 * 2**20 // (n * k)))
        ws = [torch.randn(n, k, device=dev).to(torch.float8_e4m3fn) for _ in range(copies)]
        sc = torch.rand(n, 1, device=dev) + 0.5
        floor_ms = n * k / (ctx["hbm_tb_s"] * 1e12) * 1e3
        for m in args.gemm_row_list:
            xq = torch.randn(m, k, device=dev).to(torch.float8_e4m3fn)
            xs = torch.rand(m, 1, device=dev) + 0.5
            s = auto_splits(xq, n)
            row = {"proj": name, "rows": m, "n": n, "k": k, "splits": s,
                   "floor_ms": round(floor_ms, 4),
                   "cublas_ms": round(timed(fp8_gemm, ws, xq, xs, sc, torch.bfloat16), 4),
                   "split_ms": round(timed(fp8_split_gemm, ws, xq, xs, sc, s, torch.bfloat16),
                                     4)}
            if s > 1:
                row["unsplit_ms"] = round(
                    timed(fp8_split_gemm, ws, xq, xs, sc, 1, torch.bfloat16), 4)
            row["cublas_swapped_ms"] = round(timed(swapped, ws, xq, xs, sc, torch.bfloat16), 4)
            row["cublas_swapped_back_ms"] = round(
                timed(swapped_back, ws, xq, xs, sc, torch.bfloat16), 4)
            print(json.dumps(row), flush=True)
            out.append(row)
        ws.clear()
        torch.cuda.empty_cache()
    return out
