"""The K-split FP8 x FP8 kernel (kernels/triton_fp8_split_gemm) against the torch reference
(interpreter on CPU, GPU with -m gpu), its split choice, and an FP8 layer's use of it at
decode-batch rows: partials for the reader, the product for everyone else, in a graph."""

from __future__ import annotations

import pytest
import torch
from fp8_weights import fp8_weight, rel_err

from kernels import ref_fp8

HAS_CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")


@pytest.mark.parametrize("m,k,splits", [(17, 512, 1), (40, 512, 2), (17, 384, 4),
                                        (130, 256, 1), (20, 352, 2)])
def test_split_gemm_matches_reference(m, k, splits, gen, device):
    """One scale per row and per channel; N = 160 leaves a partial column tile, m = 130 a
    partial row tile, K = 384 at 4 slices one slice past K (zeros), K = 352 half a tile."""
    from kernels.triton_fp8_split_gemm import fp8_split_gemm

    w, s = fp8_weight(160, k, 1, gen, device)
    x = torch.randn(m, k, generator=gen).to(device)
    xq, xs = ref_fp8.quant_rows(x, 1)
    dtype = torch.bfloat16 if HAS_CUDA else torch.float32
    out = fp8_split_gemm(xq, xs, w, s, splits, dtype)
    ref = ref_fp8.fp8_gemm_ref(xq, xs, w, s, torch.float32)
    if splits == 1:
        assert out.shape == (m, 160) and out.dtype == dtype
        assert rel_err(out, ref) < (1e-2 if dtype == torch.bfloat16 else 1e-5)
    else:
        assert out.shape == (splits, m, 160) and out.dtype == torch.float32
        assert rel_err(out.sum(0), ref) < 1e-5
        # each slice is its own K range: the first alone is not the product
        assert rel_err(out[0], ref) > 0.1


def test_split_gemm_static_scale_broadcast(gen, device):
    """A checkpoint's static per-tensor input scale comes expanded to [M, 1] (stride 0)."""
    from kernels.triton_fp8_split_gemm import fp8_split_gemm

    w, s = fp8_weight(64, 256, 1, gen, device)
    x = torch.randn(24, 256, generator=gen).to(device)
    xq, xs = ref_fp8.quant_static(x, torch.tensor([0.02], device=device))
    assert xs.stride(0) == 0
    out = fp8_split_gemm(xq, xs, w, s, 2, torch.float32)
    assert rel_err(out.sum(0), ref_fp8.fp8_gemm_ref(xq, xs, w, s, torch.float32)) < 1e-5


def test_split_gemm_names_bad_arguments(gen, device):
    from kernels.triton_fp8_split_gemm import fp8_split_gemm

    w, s = fp8_weight(64, 256, 1, gen, device)
    xq, xs = ref_fp8.quant_rows(torch.randn(20, 256, generator=gen).to(device), 1)
    with pytest.raises(ValueError, match="must share K"):
        fp8_split_gemm(xq[:, :128], xs, w, s, 1, torch.float32)
    with pytest.raises(ValueError, match="x_scale"):
        fp8_split_gemm(xq, xs.expand(20, 2), w, s, 1, torch.float32)
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        fp8_split_gemm(xq.float(), xs, w, s, 1, torch.float32)
    with pytest.raises(ValueError, match="splits"):
        fp8_split_gemm(xq, xs, w, s, 0, torch.float32)


def test_split_choice_for_8b_shapes_at_128_rows_on_132_sms():
    from kernels.triton_fp8_split_gemm import choose_splits

    # 128-row tiles, one program an SM: the grid stays within one wave (rounded down)
    assert choose_splits(128, 4096, 4096, 132) == 4  # o_proj: 32 column tiles x 4 = 128
    assert choose_splits(128, 4096, 14336, 132) == 4  # down_proj: 5 would be 160 programs
    assert choose_splits(96, 4096, 14336, 132) == 4  # 96 rows: the same 128-row tile
    assert choose_splits(128, 6144, 4096, 132) == 2  # qkv: 48 column tiles
    assert choose_splits(128, 28672, 4096, 132) == 1  # gate_up: 224 tiles fill the SMs
    assert choose_splits(256, 4096, 14336, 132) == 2  # two row tiles: 64 x 2
    # smaller tiles share an SM: rounded up, as measured at 64 rows
    assert choose_splits(64, 4096, 14336, 132) == 5
    assert choose_splits(32, 4096, 512, 132) == 1  # 4 tiles of K: too short to split


def _fp8_layer(n: int, k: int):
    from engine.quant.fp8_linear import Fp8Linear
    from engine.quant.scheme import Fp8Scheme

    lin = torch.nn.Linear(k, n, bias=False).to("cuda", torch.bfloat16)
    return Fp8Linear.from_float(lin, Fp8Scheme(weight="channel", act="token", block=None,
                                               scale_name=None))


@pytest.mark.gpu
@needs_cuda
def test_fp8_layer_default_rows_for_the_split_kernel(gen):
    """By default the split kernel takes the rows just past the weight-only kernel's, up
    to SPLIT_GEMM_MAX_ROWS (measured faster there), and cuBLAS the rows after; a narrow
    layer (out_features <= NARROW_OUT) keeps it up to NARROW_SPLIT_MAX_ROWS."""
    from engine.models import split_k as sk
    from engine.quant import fp8_linear as fl

    assert fl.WEIGHT_ONLY_MAX_ROWS < fl.SPLIT_GEMM_MAX_ROWS < fl.NARROW_SPLIT_MAX_ROWS
    for n, last in ((4096, fl.NARROW_SPLIT_MAX_ROWS), (6144, fl.SPLIT_GEMM_MAX_ROWS)):
        f = _fp8_layer(n, 4096)
        for rows, split in ((fl.WEIGHT_ONLY_MAX_ROWS + 1, True), (last, True),
                            (last + 1, False)):
            assert f.split_gemm(rows) == split, (n, rows)
            x = torch.randn(rows, 4096, generator=gen).to("cuda", torch.bfloat16)
            p = sk.split_k_linear(x, f)
            assert (p is not None and p.shape[1:] == (rows, n)) == split, (n, rows)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("rows", [33, 64, 128, 256])
def test_fp8_layer_partials_and_product_at_decode_batch_rows(rows, gen, monkeypatch):
    """Up to SPLIT_GEMM_MAX_ROWS (raised here to 256, so every size the kernel might be
    given is checked) an FP8 layer's reader gets the split kernel's partials, and its
    forward the same product as cuBLAS's scaled mm."""
    from engine.models import split_k as sk
    from engine.quant import fp8_linear as fl
    from kernels.triton_fp8_gemm import fp8_gemm
    from kernels.triton_fp8_split_gemm import auto_splits

    monkeypatch.setattr(fl, "SPLIT_GEMM_MAX_ROWS", 256)
    assert fl.WEIGHT_ONLY_MAX_ROWS < rows <= fl.SPLIT_GEMM_MAX_ROWS
    f = _fp8_layer(4096, 4096)
    x = torch.randn(rows, 4096, generator=gen).to("cuda", torch.bfloat16)
    xq, xs = ref_fp8.quant_rows(x, 1)
    exact = ref_fp8.fp8_gemm_ref(xq, xs, f.weight, f.weight_scale, torch.float32)
    s = auto_splits(xq, 4096)
    p = sk.split_k_linear(x, f)
    assert s > 1 and p is not None and p.shape == (s, rows, 4096) and p.dtype == torch.float32
    assert rel_err(p.sum(0), exact) < 1e-3
    y = f(x)
    cublas = fp8_gemm(xq, xs, f.weight, f.weight_scale, torch.bfloat16)
    assert y.dtype == torch.bfloat16 and rel_err(y, exact) < 1e-2
    assert rel_err(y, cublas) < 1e-2


@pytest.mark.gpu
@needs_cuda
def test_fp8_layer_split_gemm_in_a_cuda_graph(gen):
    """Captured and replayed on new input, the partials follow the input (no host sync, no
    allocation the replay misses)."""
    f = _fp8_layer(4096, 14336)
    from engine.models import split_k as sk
    from engine.quant import fp8_linear as fl

    x = torch.randn(fl.SPLIT_GEMM_MAX_ROWS, 14336, generator=gen).to("cuda", torch.bfloat16)
    sk.split_k_linear(x, f)  # compile outside the capture
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        p = sk.split_k_linear(x, f)
    assert p is not None
    x.copy_(torch.randn(x.shape[0], 14336, generator=gen).to("cuda", torch.bfloat16))
    g.replay()
    xq, xs = ref_fp8.quant_rows(x, 1)
    exact = ref_fp8.fp8_gemm_ref(xq, xs, f.weight, f.weight_scale, torch.float32)
    assert rel_err(p.sum(0), exact) < 1e-3


@pytest.mark.gpu
@needs_cuda
def test_split_gemm_limit_zero_keeps_cublas(gen, monkeypatch):
    """SPLIT_GEMM_MAX_ROWS = 0 turns the kernel off: no partials, cuBLAS's product."""
    from engine.models import split_k as sk
    from engine.quant import fp8_linear as fl

    monkeypatch.setattr(fl, "SPLIT_GEMM_MAX_ROWS", 0)
    f = _fp8_layer(4096, 4096)
    x = torch.randn(64, 4096, generator=gen).to("cuda", torch.bfloat16)
    assert not f.split_gemm(64) and sk.split_k_linear(x, f) is None


def test_split_gemm_rows_by_layer_width(monkeypatch):
    """Past SPLIT_GEMM_MAX_ROWS only a narrow layer (out_features <= NARROW_OUT) keeps the
    split kernel, up to NARROW_SPLIT_MAX_ROWS; NARROW_SPLIT_MAX_ROWS = 0 drops that, and
    SPLIT_GEMM_MAX_ROWS = 0 turns the kernel off for every layer."""
    from engine.models import split_k as sk
    from engine.quant import fp8_linear as fl
    from engine.quant.scheme import Fp8Scheme

    scheme = Fp8Scheme(weight="channel", act="token", block=None, scale_name=None)
    narrow = fl.Fp8Linear(4096, 4096, False, scheme)
    wide = fl.Fp8Linear(4096, 6144, False, scheme)
    lo, mid, top = fl.WEIGHT_ONLY_MAX_ROWS, fl.SPLIT_GEMM_MAX_ROWS, fl.NARROW_SPLIT_MAX_ROWS
    assert lo < mid < top and wide.out_features > fl.NARROW_OUT >= narrow.out_features
    assert [narrow.split_gemm(r) for r in (lo, lo + 1, mid + 1, top, top + 1)] == [
        False, True, True, True, False]
    assert [wide.split_gemm(r) for r in (lo, lo + 1, mid, mid + 1)] == [False, True, True, False]
    assert sk.fp8_max_rows() == top
    monkeypatch.setattr(fl, "NARROW_SPLIT_MAX_ROWS", 0)
    assert not narrow.split_gemm(mid + 1) and narrow.split_gemm(mid)
    assert sk.fp8_max_rows() == mid
    monkeypatch.setattr(fl, "NARROW_SPLIT_MAX_ROWS", top)
    monkeypatch.setattr(fl, "SPLIT_GEMM_MAX_ROWS", 0)
    assert not any(f.split_gemm(r) for f in (narrow, wide) for r in (lo + 1, mid, top))
    assert sk.fp8_max_rows() == lo
