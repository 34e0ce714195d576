"""RMSNorm and SiLU x mul that quantize their output per row for an FP8 x FP8 projection
(kernels/triton_norm.rms_norm_quant, kernels/triton_act.silu_and_mul_quant): the same FP8
bytes and scales as the unfused kernel followed by the quantizer (interpreter on CPU, GPU
with -m gpu), and close to the torch references."""

from __future__ import annotations

import pytest
import torch

from kernels import ref_fp8

HAS_CUDA = torch.cuda.is_available()


def _near_ref(q: torch.Tensor, s: torch.Tensor, rq: torch.Tensor, rs: torch.Tensor) -> None:
    """Against the torch reference, whose float output differs from the kernel's by a
    rounding here and there (rsqrt against 1 / sqrt): each value within one FP8 step
    (2^-3 of itself) of the reference's, but for a few."""
    deq, rdeq = ref_fp8.dequant(q, s), ref_fp8.dequant(rq, rs)
    close = ((deq - rdeq).abs() <= rdeq.abs() * 2 ** -3 + 1e-6).float().mean()
    # Triton 3.7's interpreter drops the carry of a mantissa rounded up into the next power
    # of two (-125.9 -> -64, not -128): a few values per row on CPU
    assert close > (0.999 if HAS_CUDA else 0.95), close


def _same_quant(q: torch.Tensor, s: torch.Tensor, rq: torch.Tensor, rs: torch.Tensor) -> None:
    assert q.dtype == rq.dtype == torch.float8_e4m3fn and q.shape == rq.shape
    assert s.shape == rs.shape == (q.shape[0], 1) and s.dtype == torch.float32
    torch.testing.assert_close(s, rs, rtol=0, atol=0)
    assert torch.equal(q.view(torch.uint8), rq.view(torch.uint8))


@pytest.mark.parametrize("hidden", [96, 256])
@pytest.mark.parametrize("form", ["plain", "residual", "partials"])
def test_rms_norm_quant_is_the_norm_then_the_quantizer(form, hidden, gen, device):
    from kernels.ref_norm import rms_norm_quant_ref
    from kernels.triton_fp8_gemm import quant_rows
    from kernels.triton_norm import rms_norm, rms_norm_quant

    dtype = torch.bfloat16 if HAS_CUDA else torch.float32
    t = 7
    x = torch.randn(t, hidden, generator=gen).to(device, dtype) * 3
    res = torch.randn(t, hidden, generator=gen).to(device, dtype)
    w = (torch.rand(hidden, generator=gen) + 0.5).to(device, dtype)
    if form == "partials":  # a split-K projection's float32 partial sums, with the residual
        x = torch.randn(3, t, hidden, generator=gen).to(device)
    residual = None if form == "plain" else res
    if form == "plain":
        x[2] = 0  # an all-zero row: zeros and the least scale, not NaN
    q, s, new_res = rms_norm_quant(x, w, 1e-6, residual)
    out, ref_res = rms_norm(x, w, 1e-6, residual)
    uq, us = quant_rows(out, 1)
    _same_quant(q, s, uq, us)
    assert torch.equal(new_res, ref_res)
    if form == "plain":
        assert s[2].item() == pytest.approx(1e-12) and ref_fp8.dequant(q, s)[2].abs().max() == 0
    rq, rs, rres = rms_norm_quant_ref(x, w, 1e-6, residual)
    torch.testing.assert_close(new_res, rres)
    _near_ref(q, s, rq, rs)


@pytest.mark.parametrize("inter,block", [(300, 128), (96, 2048)])
def test_silu_and_mul_quant_is_the_activation_then_the_quantizer(inter, block, gen, device,
                                                                monkeypatch):
    """block 128 over 300 columns: three passes of each loop, the last one partial."""
    import kernels.triton_act as act
    from kernels.ref_act import silu_and_mul_quant_ref
    from kernels.triton_fp8_gemm import quant_rows

    monkeypatch.setattr(act, "QUANT_BLOCK", block)
    dtype = torch.bfloat16 if HAS_CUDA else torch.float32
    x = torch.randn(5, 2 * inter, generator=gen).to(device, dtype) * 2
    x[1] = 0
    q, s = act.silu_and_mul_quant(x)
    uq, us = quant_rows(act.silu_and_mul(x), 1)
    _same_quant(q, s, uq, us)
    assert ref_fp8.dequant(q, s)[1].abs().max() == 0
    rq, rs = silu_and_mul_quant_ref(x)
    _near_ref(q, s, rq, rs)


def test_fused_quant_names_bad_input(device):
    from kernels.triton_act import silu_and_mul_quant
    from kernels.triton_norm import rms_norm_quant

    with pytest.raises(ValueError, match="x: expected"):
        silu_and_mul_quant(torch.randn(4, 7, device=device))
    with pytest.raises(ValueError, match="weight"):
        rms_norm_quant(torch.randn(4, 64, device=device), torch.ones(32, device=device), 1e-6)


def test_fused_quant_of_no_rows(device):
    from kernels.triton_act import silu_and_mul_quant
    from kernels.triton_norm import rms_norm_quant

    q, s = silu_and_mul_quant(torch.randn(0, 64, device=device))
    assert q.shape == (0, 32) and s.shape == (0, 1)
    q, s, r = rms_norm_quant(torch.randn(0, 64, device=device), torch.ones(64, device=device),
                             1e-6)
    assert q.shape == (0, 64) and s.shape == (0, 1) and r.shape == (0, 64)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
def test_fused_quant_at_8b_shapes_on_the_gpu(gen):
    """In the -m gpu suite (the tests above run on the GPU only when called without it):
    Llama-3-8B's rows (hidden 4096 with a residual and K-split partials; 14336 of SiLU x
    mul), bf16, the same bytes as the unfused kernel and the quantizer."""
    from kernels.triton_act import silu_and_mul, silu_and_mul_quant
    from kernels.triton_fp8_gemm import quant_rows
    from kernels.triton_norm import rms_norm, rms_norm_quant

    dev = torch.device("cuda")
    parts = torch.randn(2, 40, 4096, generator=gen).to(dev)
    res = torch.randn(40, 4096, generator=gen).to(dev, torch.bfloat16)
    w = (torch.rand(4096, generator=gen) + 0.5).to(dev, torch.bfloat16)
    q, s, new_res = rms_norm_quant(parts, w, 1e-5, res)
    out, ref_res = rms_norm(parts, w, 1e-5, res)
    _same_quant(q, s, *quant_rows(out, 1))
    assert torch.equal(new_res, ref_res)
    x = torch.randn(40, 2 * 14336, generator=gen).to(dev, torch.bfloat16)
    _same_quant(*silu_and_mul_quant(x), *quant_rows(silu_and_mul(x), 1))
