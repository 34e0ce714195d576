"""K-split projections whose partial sums the next RMSNorm adds (engine/models/split_k.py,
kernels/triton_norm.rms_norm with [S, T, H] input)."""

from __future__ import annotations

import pytest
import torch

from kernels.ref_norm import rms_norm_ref

HAS_CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("parts", [1, 4, 7])
def test_norm_sums_float32_partials_then_rounds_like_the_projection(dtype, parts, gen, device,
                                                                    close):
    from kernels.triton_norm import rms_norm

    t, h = 3, 96
    xp = torch.randn(parts, t, h, generator=gen).to(device)
    w = (1 + 0.1 * torch.randn(h, generator=gen)).to(dtype=dtype, device=device)
    res = torch.randn(t, h, generator=gen).to(dtype=dtype, device=device)
    out, new_res = rms_norm(xp, w, 1e-5, res)
    assert out.dtype == dtype and new_res.dtype == dtype and out.shape == (t, h)
    # the same as the norm of the projection's rounded output
    whole = xp.sum(0).to(dtype)
    ref_out, ref_res = rms_norm_ref(whole, w, 1e-5, res)
    close(out, ref_out, dtype)
    close(new_res, ref_res, dtype)
    ref2_out, ref2_res = rms_norm_ref(xp, w, 1e-5, res)
    assert torch.equal(ref2_res, ref_res) and torch.equal(ref2_out, ref_out)


def test_norm_rejects_partials_without_a_residual_or_in_low_precision(device):
    from kernels.triton_norm import rms_norm

    w = torch.ones(8, device=device)
    with pytest.raises(ValueError, match="residual"):
        rms_norm(torch.zeros(2, 1, 8, device=device), w, 1e-5)
    with pytest.raises(ValueError, match="float32"):
        rms_norm(torch.zeros(2, 1, 8, dtype=torch.bfloat16, device=device), w.bfloat16(), 1e-5,
                 torch.zeros(1, 8, dtype=torch.bfloat16, device=device))


def test_split_counts():
    from engine.models.split_k import splits_for

    assert splits_for(4096) == 2 and splits_for(14336) == 2 and splits_for(7) == 1


def test_split_k_is_off_on_cpu_and_for_biased_or_many_row_inputs():
    from engine.models import split_k as sk

    lin = torch.nn.Linear(64, 32, bias=False)
    assert sk.split_k_linear(torch.randn(1, 64), lin) is None  # CPU: cuBLAS only
    if HAS_CUDA:
        lin = lin.cuda()
        assert sk.split_k_linear(torch.randn(sk.MAX_ROWS + 1, 64, device="cuda"), lin) is None
        assert sk.split_k_linear(torch.randn(1, 64, device="cuda"),
                                 torch.nn.Linear(64, 32).cuda()) is None


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("rows", [1, 2, 4])
@pytest.mark.parametrize("k", [4096, 14336, 896])
def test_split_k_partials_and_norm_match_linear_then_norm(rows, k, gen, close):
    from engine.models.split_k import split_k_linear
    from kernels.triton_norm import rms_norm

    dev = torch.device("cuda")
    lin = torch.nn.Linear(k, 4096, bias=False).to(device=dev, dtype=torch.bfloat16)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(4096, k, generator=gen) * k ** -0.5)
    x = torch.randn(rows, k, generator=gen).to(device=dev, dtype=torch.bfloat16)
    res = torch.randn(rows, 4096, generator=gen).to(device=dev, dtype=torch.bfloat16)
    w = torch.ones(4096, dtype=torch.bfloat16, device=dev)
    with torch.no_grad():
        parts = split_k_linear(x, lin)
        assert parts is not None and parts.dtype == torch.float32 and parts.shape[1] == rows
        full = torch.nn.functional.linear(x.float(), lin.weight.float())
        assert torch.allclose(parts.sum(0), full, rtol=1e-4, atol=1e-3)
        out, new_res = rms_norm(parts, w, 1e-5, res)
        ref_out, ref_res = rms_norm(lin(x), w, 1e-5, res)
    close(out, ref_out, torch.bfloat16)
    close(new_res, ref_res, torch.bfloat16)


class _CountingLinear(torch.nn.Linear):
    """Records every attribute nn.Module.__getattr__ is asked for (each one a miss that
    raises AttributeError inside it)."""

    def __init__(self, *args, **kwargs) -> None:
        object.__setattr__(self, "misses", [])  # plain attribute, before Module's setup
        super().__init__(*args, **kwargs)
        self.misses.clear()  # (none expected from the setup; only split_k's count)

    def __getattr__(self, name: str):
        object.__getattribute__(self, "misses").append(name)
        return super().__getattr__(name)


def test_split_k_on_cpu_answers_without_a_module_attribute_miss():
    # Three projections of every layer ask in every step; on a float layer a `partials`
    # lookup through the instance misses, and nn.Module answers a miss by raising.
    from engine.models import split_k as sk

    lin = _CountingLinear(64, 32, bias=False)
    for rows in (1, sk.MAX_ROWS, sk.MAX_ROWS + 1):
        assert sk.split_k_linear(torch.randn(rows, 64), lin) is None
    assert lin.misses == []


@pytest.mark.gpu
@needs_cuda
def test_fp8_layers_give_partials_up_to_the_weight_only_rows(gen):
    """An FP8 layer's K-split partials go to the reader up to the weight-only kernel's
    limit, not only MAX_ROWS: above 4 rows the sum and cast otherwise ran in torch. The
    partials add up to the dequantized product. (Past that limit the FP8 x FP8 split kernel
    makes them: tests/kernels/test_fp8_split_gemm.py.)"""
    from engine.models import split_k as sk
    from engine.quant.fp8_linear import WEIGHT_ONLY_MAX_ROWS, Fp8Linear
    from engine.quant.scheme import Fp8Scheme
    from kernels import ref_fp8
    from kernels.triton_fp8_weight_only import auto_splits

    assert sk.fp8_max_rows() >= WEIGHT_ONLY_MAX_ROWS > sk.MAX_ROWS
    lin = torch.nn.Linear(4096, 4096, bias=False).to("cuda", torch.bfloat16)
    f = Fp8Linear.from_float(lin, Fp8Scheme(weight="channel", act="token", block=None,
                                            scale_name=None))
    wd = ref_fp8.dequant(f.weight, f.weight_scale)
    for rows in (1, 8, WEIGHT_ONLY_MAX_ROWS):
        x = torch.randn(rows, 4096, generator=gen).to("cuda", torch.bfloat16)
        s = auto_splits(x, 4096, f.groups)
        assert s > 1, (rows, s)  # a 4096 x 4096 GEMV at these rows splits K on any GPU here
        p = sk.split_k_linear(x, f)
        assert p is not None and p.shape == (s, rows, 4096) and p.dtype == torch.float32
        ref = x.float() @ wd.t()
        assert ((p.sum(0) - ref).norm() / ref.norm()).item() < 1e-2, rows
    x = torch.randn(sk.fp8_max_rows() + 1, 4096, device="cuda", dtype=torch.bfloat16)
    assert sk.split_k_linear(x, f) is None  # cuBLAS's FP8 x FP8 from here: no partials
