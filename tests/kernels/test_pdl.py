"""Programmatic dependent launch (kernels/pdl.py): when it is on, and that a kernel started
early never reads what the kernel before it has not yet written.

The race test captures a many-row RMSNorm (its last row's program starts last) and then
the FP8 GEMV on that last row in a CUDA graph, where PDL starts the GEMV's programs while
the norm still runs: without the GEMV's wait it reads the norm's output before the norm
wrote it. That buffer is handed out full of NaN (the allocator's block of a freed NaN
tensor of the same size, refilled at every replay), so an early read shows as NaN, never as
a lucky equal value. On the H200 it failed with the wait taken out of the GEMV (session 22);
eager launches leave too much host time between the two kernels to show it.
"""

from __future__ import annotations

import pytest
import torch

import kernels.pdl as pdl

needs_sm90 = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9,
    reason="PDL needs a CUDA GPU of compute capability 9.0 or later")


def test_pdl_is_off_on_the_cpu_and_when_disabled(monkeypatch):
    assert not pdl.pdl_for(torch.zeros(1))
    if torch.cuda.is_available():
        monkeypatch.setattr(pdl, "ENABLED", False)
        assert not pdl.pdl_for(torch.zeros(1, device="cuda"))


def _norm_then_gemv(rows: int, hidden: int, n: int, gen: torch.Generator):
    from kernels.triton_fp8_weight_only import fp8_weight_only
    from kernels.triton_norm import rms_norm

    dev = torch.device("cuda")
    x = torch.randn(rows, hidden, generator=gen).to(dev, torch.bfloat16)
    w_norm = torch.rand(hidden, generator=gen).to(dev, torch.bfloat16) + 0.5
    w = (torch.randn(n, hidden, generator=gen) * 0.5).to(dev).to(torch.float8_e4m3fn)
    s = torch.rand(n, 1, generator=gen).to(dev) * 0.01 + 0.001

    def run() -> torch.Tensor:
        poison = torch.full((rows, hidden), float("nan"), dtype=torch.bfloat16, device=dev)
        del poison  # rms_norm's output takes this block back, NaN inside
        normed, _ = rms_norm(x, w_norm, 1e-5)
        return fp8_weight_only(normed[-1:], w, s)

    return run, (x, w_norm, w, s)


@pytest.mark.gpu
@needs_sm90
def test_eager_norm_then_gemv_with_pdl_matches_the_reference(monkeypatch):
    from kernels import ref_fp8
    from kernels.ref_norm import rms_norm_ref

    gen = torch.Generator().manual_seed(0)
    run, (x, w_norm, w, s) = _norm_then_gemv(8192, 4096, 14336, gen)
    ref = ref_fp8.fp8_weight_only_ref(rms_norm_ref(x[-1:], w_norm, 1e-5)[0], w, s)
    monkeypatch.setattr(pdl, "ENABLED", True)
    outs = [run() for _ in range(20)]
    torch.cuda.synchronize()
    for out in outs:
        assert torch.isfinite(out).all()
        assert torch.equal(out, outs[0])
    assert (out.float() - ref.float()).norm() / ref.float().norm() < 1e-2


@pytest.mark.gpu
@needs_sm90
def test_graph_gemv_started_early_reads_the_norms_finished_output(monkeypatch):
    """The race test: the chain captured in a CUDA graph, PDL on and off, the same bits."""
    gen = torch.Generator().manual_seed(1)
    run, _ = _norm_then_gemv(4096, 4096, 6144, gen)
    results = {}
    for on in (False, True):
        monkeypatch.setattr(pdl, "ENABLED", on)
        run()  # compile outside the capture
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            out = run()
        for _ in range(10):
            g.replay()
        torch.cuda.synchronize()
        results[on] = out.clone()
    assert torch.isfinite(results[True]).all(), \
        "the GEMV read the norm's output before the norm wrote it"
    assert torch.equal(results[True], results[False])
