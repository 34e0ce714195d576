"""What cuBLAS's fast FP8 accumulation costs in accuracy, GEMM by GEMM, at a model's shapes.

Hopper's FP8 tensor cores keep their running sums in reduced precision; cuBLAS by default
promotes them into float32 every few K steps, and with ``use_fast_accum`` it does not (vLLM's
Hopper FP8 GEMMs run so). The error that skipping the promotion adds grows with K, so a
small model's K (SmolLM2: 576 and 1536) says little about an 8B's (4096 and 14336). This
script prices it per projection, on the operands the engine builds (per-channel weights with
the engine's searched scales, activations quantized per row by the engine's quantizer):

  * exact: the dequantized FP8 operands multiplied in float32 (TF32 off): what an FP8 GEMM
    with perfect accumulation returns, before its bf16 output rounding;
  * default / fast: torch._scaled_mm with bf16 output, promotion on / off;
  * bf16: the unquantized operands in cuBLAS bf16, and float32, for FP8's own error.

Per projection and row count it reports relative Frobenius errors (||a - b|| / ||b||) and
the 99.9th percentile of |a - b| over the output's RMS, for fast vs exact, default vs exact
and exact vs float32 (FP8's quantization error), and fast's added error as a share of the
quantization error. Activations are Gaussian rows with 1% of the channels 20x larger (the
outlier channels LLM activations carry); weights Gaussian with per-row spread.

    python3 bench/fp8_accum_error.py --out bench/results/fp8_accum_error_h200.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# (name, N, K): Llama-3-8B's projections, and SmolLM2-135M's for the small-K end
SHAPES = {
    "llama3_8b": [("qkv_proj", 6144, 4096), ("o_proj", 4096, 4096),
                  ("gate_up_proj", 28672, 4096), ("down_proj", 4096, 14336)],
    "smollm2_135m": [("qkv_proj", 960, 576), ("o_proj", 576, 576),
                     ("gate_up_proj", 3072, 576), ("down_proj", 576, 1536)],
}


def activations(m: int, k: int, gen: torch.Generator) -> torch.Tensor:
    x = torch.randn(m, k, generator=gen, device="cuda")
    outliers = torch.randperm(k, generator=gen, device="cuda")[: max(1, k // 100)]
    x[:, outliers] *= 20.0
    return x.to(torch.bfloat16)


def weights(n: int, k: int, gen: torch.Generator) -> torch.Tensor:
    spread = torch.exp(0.5 * torch.randn(n, 1, generator=gen, device="cuda"))
    return (0.02 * spread * torch.randn(n, k, generator=gen, device="cuda")).to(torch.bfloat16)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30))


def tail(a: torch.Tensor, b: torch.Tensor, rms: float) -> float:
    d = (a.float() - b.float()).abs().flatten()
    # a strided sample: torch.quantile refuses tensors past 16M elements
    step = max(1, d.numel() // (1 << 23))
    return float(torch.quantile(d[::step], 0.999) / rms)


def point(name: str, n: int, k: int, m: int, seed: int) -> dict:
    from engine.quant.weight_scale import mse_channel_quantize
    from kernels.ref_fp8 import dequant
    from kernels.triton_fp8_gemm import quant_rows

    gen = torch.Generator(device="cuda").manual_seed(seed)
    x = activations(m, k, gen)
    w = weights(n, k, gen)
    wq, ws = mse_channel_quantize(w)
    xq, xs = quant_rows(x, 1)
    exact = dequant(xq, xs) @ dequant(wq, ws).t()
    full = x.float() @ w.float().t()
    bf16 = x @ w.t()
    out = {}
    for fast in (False, True):
        out[fast] = torch._scaled_mm(xq, wq.t(), scale_a=xs.contiguous(),
                                     scale_b=ws.reshape(1, -1), out_dtype=torch.bfloat16,
                                     use_fast_accum=fast)
    rms = float(exact.pow(2).mean().sqrt())
    r = {"projection": name, "n": n, "k": k, "rows": m,
         "fast_vs_exact": rel(out[True], exact), "default_vs_exact": rel(out[False], exact),
         "fast_vs_default": rel(out[True], out[False]),
         "fp8_quant_vs_float32": rel(exact, full), "bf16_vs_float32": rel(bf16, full),
         "fast_vs_exact_p999_over_rms": tail(out[True], exact, rms),
         "default_vs_exact_p999_over_rms": tail(out[False], exact, rms),
         "fp8_quant_p999_over_rms": tail(exact, full, rms)}
    # fast's own contribution beyond the bf16 output rounding that both forms share
    r["fast_added_share_of_quant_error"] = max(
        0.0, r["fast_vs_exact"] - r["default_vs_exact"]) / max(r["fp8_quant_vs_float32"], 1e-30)
    return {key: (round(v, 6) if isinstance(v, float) else v) for key, v in r.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="128,4096", help="M values (decode batch, prefill)")
    ap.add_argument("--models", default="llama3_8b,smollm2_135m")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="bench/results/fp8_accum_error_h200.json")
    args = ap.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False  # "exact" must accumulate in float32
    rows = [int(r) for r in args.rows.split(",") if r]
    points = []
    for model in args.models.split(","):
        for name, n, k in SHAPES[model]:
            for m in rows:
                p = point(name, n, k, m, args.seed)
                p["model"] = model
                points.append(p)
                print(json.dumps(p), flush=True)
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
              "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "points": points}
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
