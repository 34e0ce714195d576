"""FP8 linear kernels against their torch references (interpreter on CPU, GPU with -m gpu):
weight-only (per-channel and block scales, K-split partials), FP8 x FP8 (the block-scaled
Triton kernel, cuBLAS's row-wise scaled mm), and the per-row activation quantizer."""

from __future__ import annotations

import pytest
import torch
from fp8_weights import fp8_weight, rel_err

from kernels import ref_fp8

HAS_CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")


@pytest.mark.parametrize("groups", [1, 4])  # per channel; 128-column blocks
@pytest.mark.parametrize("m,splits", [(1, 1), (3, 2), (20, 1), (20, 4)])
def test_weight_only_matches_reference(m, splits, groups, gen, device):
    from kernels.triton_fp8_weight_only import fp8_weight_only

    dtype = torch.bfloat16 if HAS_CUDA else torch.float32
    w, s = fp8_weight(96, 512, groups, gen, device)  # N=96: a partial column tile
    x = torch.randn(m, 512, generator=gen).to(device=device, dtype=dtype)
    out = fp8_weight_only(x, w, s, splits=splits)
    ref = ref_fp8.fp8_weight_only_ref(x, w, s, splits=splits)
    assert out.shape == ref.shape == ((m, 96) if splits == 1 else (splits, m, 96))
    assert out.dtype == (dtype if splits == 1 else torch.float32)
    assert rel_err(out, ref) < (1e-2 if dtype == torch.bfloat16 else 1e-5)
    if splits > 1:  # the partials add up to the product
        assert rel_err(out.sum(0), ref_fp8.fp8_weight_only_ref(x.float(), w, s)) < 1e-2


def test_split_choice_for_8b_shapes_on_132_sms():
    from kernels.triton_fp8_weight_only import choose_splits

    # Llama-3-8B at batch 1 (the GEMV kernel's tiles per shape class, GEMV_TABLE):
    # qkv and o_proj (32 x 256 tiles, >= 5 programs per SM, >= 2 tiles a range), down_proj
    # (16 x 256, >= 6 per SM; per channel, and 128-column blocks)
    assert choose_splits(1, 6144, 4096, 1, 132) == 4
    assert choose_splits(1, 4096, 4096, 1, 132) == 8  # 8 ranges of 512 columns
    assert choose_splits(1, 4096, 14336, 1, 132) == 4
    assert choose_splits(1, 4096, 14336, 112, 132) == 4  # 28 whole blocks per range
    assert choose_splits(1, 28672, 4096, 1, 132) == 1  # gate_up fills the SMs unsplit
    assert choose_splits(1, 4096, 384, 1, 132) == 1  # too short to split
    # past GEMV_MAX_M rows, the tensor-core kernel's rule (2 programs per SM)
    assert choose_splits(16, 6144, 4096, 1, 132) == 4


def test_weight_only_refuses_a_split_inside_a_scale_group(gen, device):
    from kernels.triton_fp8_weight_only import fp8_weight_only

    w, s = fp8_weight(32, 256, 2, gen, device)
    with pytest.raises(ValueError, match="cuts a scale group"):
        fp8_weight_only(torch.randn(1, 256, device=device), w, s, splits=4)


@pytest.mark.parametrize("groups", [1, 2])
@pytest.mark.parametrize("m", [5, 130])
def test_block_gemm_matches_reference(m, groups, gen, device):
    from kernels.triton_fp8_gemm import fp8_block_gemm

    w, s = fp8_weight(96, 256, groups, gen, device)
    x = torch.randn(m, 256, generator=gen).to(device)
    xq, xs = ref_fp8.quant_rows(x, groups)
    dtype = torch.bfloat16 if HAS_CUDA else torch.float32
    out = fp8_block_gemm(xq, xs, w, s, dtype)
    ref = ref_fp8.fp8_gemm_ref(xq, xs, w, s, dtype)
    assert out.dtype == dtype and out.shape == (m, 96)
    assert rel_err(out, ref) < (1e-2 if dtype == torch.bfloat16 else 1e-5)


def test_block_gemm_per_channel_weight_with_grouped_activations(gen, device):
    """A per-channel scale expanded to [N, G] (stride 0) against x's group scales."""
    from kernels.triton_fp8_gemm import fp8_block_gemm

    w, s = fp8_weight(96, 256, 1, gen, device)
    x = torch.randn(20, 256, generator=gen).to(device)
    x[:, 7] *= 50  # an outlier column: per-row scales would flatten the rest of the row
    xq, xs = ref_fp8.quant_rows(x, 4)
    dtype = torch.bfloat16 if HAS_CUDA else torch.float32
    out = fp8_block_gemm(xq, xs, w, s.expand(96, 4), dtype)
    exact = x.float() @ ref_fp8.dequant(w, s).t()
    assert rel_err(out, ref_fp8.fp8_gemm_ref(xq, xs, w, s.expand(96, 4), dtype)) < (
        1e-2 if HAS_CUDA else 1e-5)
    xq1, xs1 = ref_fp8.quant_rows(x, 1)
    per_row = ref_fp8.fp8_gemm_ref(xq1, xs1, w, s, torch.float32)
    assert rel_err(out, exact) < rel_err(per_row, exact)  # the groups are what makes it closer


@pytest.mark.parametrize("groups", [1, 4])
def test_quant_rows_matches_reference(groups, gen, device):
    from kernels.triton_fp8_gemm import quant_rows

    x = torch.randn(7, 512, generator=gen).to(device) * 3
    x[2] = 0  # an all-zero row: zeros, not NaN
    q, s = quant_rows(x, groups)
    rq, rs = ref_fp8.quant_rows(x, groups)
    torch.testing.assert_close(s, rs, rtol=1e-6, atol=0)
    deq, rdeq = ref_fp8.dequant(q, s), ref_fp8.dequant(rq, rs)
    assert torch.isfinite(deq).all() and deq[2].abs().max() == 0
    same = (deq == rdeq).float().mean()
    if HAS_CUDA:  # the hardware conversion rounds as torch's does
        assert same > 0.999
        assert (deq - rdeq).abs().max() <= x.abs().max() * 2 ** -3
    else:  # Triton 3.7's interpreter drops the carry of a mantissa rounded up into the
        # next power of two (-125.9 -> -64, not -128): a few values per row
        assert same > 0.95


def test_quantize_weight_scale_shapes(gen):
    w = torch.randn(200, 300, generator=gen)
    for strategy, shape in (("tensor", (1,)), ("channel", (200, 1))):
        q, s = ref_fp8.quantize_weight(w, strategy)
        assert q.dtype == ref_fp8.FP8 and tuple(s.shape) == shape
        assert rel_err(q.float() * s, w) < 0.04
    q, s = ref_fp8.quantize_weight(w, "block", (128, 128))
    assert tuple(s.shape) == (2, 3)
    full = s.repeat_interleave(128, 0)[:200].repeat_interleave(128, 1)[:, :300]
    assert rel_err(q.float() * full, w) < 0.04


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("fast", [True, False])
@pytest.mark.parametrize("m", [16, 37, 128, 4096])
@pytest.mark.parametrize("n,k", [(6144, 4096), (4096, 14336), (200, 4096)])
def test_scaled_mm_per_token_per_channel(m, n, k, fast, gen, monkeypatch):
    """Both accumulation modes (FAST_ACCUM: cuBLAS's fast FP8 accumulation, on by
    default) within the same bounds of the float32 product, K = 14336 included."""
    import kernels.triton_fp8_gemm as tg
    from kernels.triton_fp8_gemm import fp8_gemm, quant_rows

    monkeypatch.setattr(tg, "FAST_ACCUM", fast)
    dev = torch.device("cuda")
    w, s = fp8_weight(n, k, 1, gen, dev)
    x = torch.randn(m, k, generator=gen).to(dev, torch.bfloat16)
    xq, xs = quant_rows(x, 1)
    out = fp8_gemm(xq, xs, w, s, torch.bfloat16)
    assert rel_err(out, ref_fp8.fp8_gemm_ref(xq, xs, w, s, torch.float32)) < 1e-2
    assert rel_err(out, x.float() @ ref_fp8.dequant(w, s).t()) < 0.05  # activation rounding


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("m", [1, 4, 16, 64])
@pytest.mark.parametrize("n,k,groups", [(6144, 4096, 1), (4096, 14336, 1), (28672, 4096, 32),
                                        (4096, 14336, 112)])
def test_weight_only_8b_shapes_auto_splits(m, n, k, groups, gen):
    from kernels.triton_fp8_weight_only import auto_splits, fp8_weight_only

    dev = torch.device("cuda")
    w, s = fp8_weight(n, k, groups, gen, dev)
    x = torch.randn(m, k, generator=gen).to(dev, torch.bfloat16)
    splits = auto_splits(x, n, groups)
    out = fp8_weight_only(x, w, s, splits=splits)
    got = out if splits == 1 else out.sum(0)
    assert rel_err(got, ref_fp8.fp8_weight_only_ref(x.float(), w, s)) < 1e-2


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("weight", ["channel", "block"])
def test_fp8_linear_in_a_cuda_graph(weight, gen):
    """Fp8Linear at decode (weight-only, with partials) and prefill (FP8 x FP8) sizes,
    captured in CUDA graphs, equals its eager self and the dequantized product."""
    from engine.quant.fp8_linear import WEIGHT_ONLY_MAX_ROWS, Fp8Linear
    from engine.quant.scheme import Fp8Scheme

    dev = torch.device("cuda")
    lin = torch.nn.Linear(4096, 4096, bias=False).to(dev, torch.bfloat16)
    scheme = Fp8Scheme(weight=weight, act="token", block=(128, 128) if weight == "block"
                       else None, scale_name=None)
    f = Fp8Linear.from_float(lin, scheme)
    wd = ref_fp8.dequant(f.weight, f.weight_scale)
    for m in (1, 4, WEIGHT_ONLY_MAX_ROWS, 64, 512):
        x = torch.randn(m, 4096, generator=gen).to(dev, torch.bfloat16)
        eager = f(x)
        g = torch.cuda.CUDAGraph()
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            f(x)
        torch.cuda.current_stream().wait_stream(s)
        with torch.cuda.graph(g):
            out = f(x)
        g.replay()
        torch.cuda.synchronize()
        torch.testing.assert_close(out, eager)
        tol = 1e-2 if f.weight_only(m) else 0.05
        assert rel_err(out, x.float() @ wd.t()) < tol, m
        p = f.partials(x)
        if p is not None:
            assert rel_err(p.sum(0), x.float() @ wd.t()) < tol, m
