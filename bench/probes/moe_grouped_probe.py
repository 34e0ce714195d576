"""The routed experts of one MoE layer at a prefill size, three ways on one GPU: the fused
MoE kernel's decode form (its tile table's config), its tensor-memory form and the
grouped-GEMM form (kernels/moe_grouped_gemm.py), with a dense bf16 GEMM of the same
FLOPs as the matmul-rate reference, all in one run. DeepSeek-V2-Lite's and Qwen3-30B-A3B's
expert shapes, uniform routing, random weights (the time does not depend on the values).

    python3 bench/probes/moe_grouped_probe.py [--tokens 4096] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

SHAPES = {"v2lite": (64, 2048, 1408, 6), "qwen3": (128, 2048, 768, 8)}  # E, H, I, k


def time_ms(fn, reps: int = 20) -> float:  # type: ignore[no-untyped-def]
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(reps):
        fn()
    b.record()
    b.synchronize()
    return a.elapsed_time(b) / reps


def point(shape: str, t: int) -> dict[str, object]:
    import kernels.moe_grouped_gemm as g
    import kernels.triton_moe_tma as tma
    from kernels.triton_moe import fused_moe, tile_config

    e, h, inter, k = SHAPES[shape]
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    x = torch.randn(t, h, dtype=torch.bfloat16, device=dev, generator=gen)
    w13 = torch.randn(e, 2 * inter, h, dtype=torch.bfloat16, device=dev, generator=gen) * h ** -0.5
    w2 = torch.randn(e, h, inter, dtype=torch.bfloat16, device=dev, generator=gen) * inter ** -0.5
    ids = torch.rand(t, e, device=dev, generator=gen).argsort(dim=1)[:, :k].to(torch.int32)
    wts = torch.softmax(torch.randn(t, k, device=dev, generator=gen), dim=-1)
    flops = 2 * t * k * 3 * h * inter
    out: dict[str, object] = {"shape": shape, "tokens": t, "experts": e, "top_k": k}
    forms = {}
    cfg = tile_config(t, dev)
    forms["decode_form"] = lambda: fused_moe(x, w13, w2, wts, ids, 0, config=dict(cfg))

    def form(tma_min, grouped_min):  # type: ignore[no-untyped-def]
        """fused_moe with the two forms' thresholds set for the call (grouped is its first
        pick, then the tensor-memory form)."""
        def run():  # type: ignore[no-untyped-def]
            old = tma.MIN_TOKENS, g.MIN_TOKENS
            tma.MIN_TOKENS, g.MIN_TOKENS = tma_min, grouped_min
            try:
                return fused_moe(x, w13, w2, wts, ids, 0)
            finally:
                tma.MIN_TOKENS, g.MIN_TOKENS = old
        return run

    forms["tma_form"] = form(1, None)
    if g.available():
        forms["grouped_form"] = form(None, 1)
    results = {}
    for name, fn in forms.items():
        try:
            ys = fn()
            ms = time_ms(fn)
            results[name] = ys
            out[name] = {"ms": round(ms, 3), "tflops": round(flops / ms / 1e9, 1)}
        except Exception as exc:  # a form this torch or GPU lacks: say so, keep the rest
            out[name] = {"error": repr(exc)[:300]}
        print(shape, name, out[name], flush=True)
    if "decode_form" in results:
        ref = results["decode_form"].double()
        for name, ys in results.items():
            out[name]["rel_err_vs_decode_form"] = float((ys.double() - ref).norm() / ref.norm())
    a = torch.randn(t * k, h, dtype=torch.bfloat16, device=dev)
    b = torch.randn(h, 3 * inter, dtype=torch.bfloat16, device=dev)
    mm = time_ms(lambda: a @ b)  # the same FLOPs as one dense GEMM
    out["dense_same_flops"] = {"ms": round(mm, 3), "tflops": round(flops / mm / 1e9, 1)}
    print(shape, "dense", out["dense_same_flops"], flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--shapes", default="v2lite,qwen3")
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    res = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
           "points": [point(s, args.tokens) for s in args.shapes.split(",")]}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
