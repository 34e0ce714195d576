"""How far down + sum + the next layer's norm (kernels/triton_moe_down_sum.py, NEXT_NORM) is
from the unfused launches, FP8 experts at H = 7168 (the one case tests/kernels/
test_moe_down_sum_norm.py allows a difference): the test's own graph of 24 launches, replayed
with fresh inputs; per step the worst element of |new_res - unfused| against the bound the
test asserts (an ulp of each weighted pair row, of the MoE row and of the sum), the values
there, and whether two replays of the same inputs agree (a race would not).

    python bench/probes/down_sum_norm_diff.py
"""

from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def main() -> None:
    from kernels.pdl import pdl_for
    from kernels.ref_fp8 import quantize_stack
    from kernels.triton_moe_down_sum import down_sum
    from kernels.triton_norm import rms_norm

    h, inter, k, shared = 7168, 2048, 8, 1
    gen = torch.Generator().manual_seed(0)
    dev = torch.device("cuda")
    layers, e, n, eps = 24, k + shared + 4, k + shared, 1e-6
    w2f = torch.randn(e, h, inter, generator=gen) * inter**-0.5
    q2, s2 = quantize_stack(w2f, None)
    w2, scale = q2.to(dev), s2.to(dev)
    wdq = (q2.float() * s2.float().view(e, h, 1)).to(dev)  # the dequantized weight
    act = torch.randn(layers, n, inter, generator=gen).to(dev, torch.bfloat16)
    res = (torch.randn(layers, 1, h, generator=gen) * 4).to(dev, torch.bfloat16)
    nw = (1 + 0.3 * torch.randn(layers, h, generator=gen)).to(dev, torch.bfloat16)
    ids = torch.stack([torch.cat([torch.randperm(e - shared, generator=gen)[:k],
                                  torch.arange(e - shared, e)]) for _ in range(layers)]
                      ).view(layers, 1, n).to(dev)
    wts = torch.cat([torch.rand(layers, 1, k, generator=gen), torch.ones(layers, 1, shared)],
                    dim=2).to(dev)
    pdl = pdl_for(act)

    def fused(i: int):  # type: ignore[no-untyped-def]
        out = torch.empty(1, h, dtype=torch.bfloat16, device=dev)
        return down_sum(act[i], w2, ids[i], wts[i], out, 0, scale, pdl, (nw[i], eps, res[i]))

    def unfused(i: int):  # type: ignore[no-untyped-def]
        out = torch.empty(1, h, dtype=torch.bfloat16, device=dev)
        down_sum(act[i], w2, ids[i], wts[i], out, 0, scale, pdl)
        return (*rms_norm(out, nw[i], eps, res[i]), out)

    fused(0)
    unfused(0)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = [fused(i) for i in range(layers)]
    worst_all = 0.0
    for step in range(20):
        act.copy_(torch.randn(layers, n, inter, generator=gen).to(dev, torch.bfloat16))
        res.copy_((torch.randn(layers, 1, h, generator=gen) * 4).to(dev, torch.bfloat16))
        graph.replay()
        first = [o[1].clone() for o in outs]
        graph.replay()
        same = all(torch.equal(a, o[1]) for a, o in zip(first, outs, strict=True))
        for i in range(layers):
            new_res = outs[i][1].float()
            want = unfused(i)
            diff = (new_res - want[1].float()).abs()
            rows = torch.einsum("pi,phi->ph", act[i].float(), wdq[ids[i][0]])  # [n, h]
            absum = (rows.abs() * wts[i][0].view(-1, 1)).sum(0)  # the pairs' |contributions|
            # the test's bound: an ulp (<= 2^-7) of each weighted pair row, the MoE row, the sum
            ulp = (absum + want[2].float().abs() + want[1].float().abs()) * 2.0**-8
            ratio = (diff / (2 * ulp)).max().item()
            j = int((diff / (2 * ulp)).argmax())
            worst_all = max(worst_all, ratio)
            if ratio > 1 or i == 0:
                print(f"step {step} layer {i}: replays equal {same}; worst diff/(2 ulp) "
                      f"{ratio:.3g} at col {j}: fused {new_res[0, j].item():.6g} unfused "
                      f"{want[1][0, j].item():.6g} moe {want[2][0, j].item():.6g} res "
                      f"{res[i][0, j].item():.6g} pairs' |sum| {absum[j].item():.6g}; "
                      f"elements over the bound {int((diff > 2 * ulp).sum())}; max diff "
                      f"{diff.max().item():.3g}", flush=True)
    print(f"worst diff / (2 ulp) over all steps and layers: {worst_all:.3g}")


if __name__ == "__main__":
    main()
