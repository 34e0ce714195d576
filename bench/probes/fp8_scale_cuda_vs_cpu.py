"""Where the CUDA MSE scale search (engine/quant/weight_scale.py) departs from the CPU's:
fraction of rows with the same scale, FP8 bytes at the same scale, and how much worse (by
the CPU's float64 reckoning) each device's pick is than the best shrink.
  python3 bench/probes/fp8_scale_cuda_vs_cpu.py [--device cuda]"""

from __future__ import annotations

import argparse
import json

import torch

from engine.quant.weight_scale import SHRINKS, mse_channel_quantize
from kernels.ref_fp8 import FP8, FP8_MAX


def errors64(w: torch.Tensor, scale: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    return (q.double() * scale.double() - w.double()).square().sum(dim=1)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda")
    a = ap.parse_args()
    g = torch.Generator().manual_seed(3)
    w = (torch.randn(4096, 14336, generator=g) * 0.02).to(torch.bfloat16)
    q, s = mse_channel_quantize(w)
    qg, sg = mse_channel_quantize(w.to(a.device))
    qg, sg = qg.cpu(), sg.cpu()
    same = (s == sg).squeeze(1)
    out: dict[str, object] = {"rows_same_scale": same.float().mean().item()}
    out["bytes_equal_where_same"] = bool(torch.equal(q[same].view(torch.uint8),
                                                     qg[same].view(torch.uint8)))
    # the CPU's fp8 cast of the GPU's scale: does the GPU round x / scale the same way?
    wf = w.float()
    q_cpu_at_g = (wf / sg).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    out["bytes_equal_cpu_cast_at_gpu_scale"] = bool(torch.equal(
        q_cpu_at_g.view(torch.uint8), qg.view(torch.uint8)))
    e_cpu, e_gpu = errors64(w, s, q), errors64(w, sg, qg)
    # the true best shrink per row, in float64
    amax = (wf.abs().amax(dim=1, keepdim=True) / FP8_MAX)
    best = None
    for sh in SHRINKS:
        sc = amax * sh
        e = errors64(w, sc, (wf / sc).clamp(-FP8_MAX, FP8_MAX).to(FP8))
        best = e if best is None else torch.minimum(best, e)
    assert best is not None
    rel_cpu, rel_gpu = (e_cpu / best - 1), (e_gpu / best - 1)
    out["cpu_pick_worse_than_best"] = {"max": rel_cpu.max().item(), "mean": rel_cpu.mean().item()}
    out["gpu_pick_worse_than_best"] = {"max": rel_gpu.max().item(), "mean": rel_gpu.mean().item()}
    out["total_err_gpu_over_cpu"] = (e_gpu.sum() / e_cpu.sum()).item()
    ratio = (sg / s).squeeze(1)
    out["scale_ratio_gpu_over_cpu"] = {"min": ratio.min().item(), "max": ratio.max().item()}
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
