"""Fused silu(gate) * up against its torch reference (interpreter on CPU, GPU with -m gpu)."""

from __future__ import annotations

import pytest
import torch

from kernels.ref_act import silu_and_mul_ref

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _case(t: int, inter: int, dtype: torch.dtype, gen, device, close) -> None:
    from kernels.triton_act import silu_and_mul

    x = (torch.randn(t, 2 * inter, generator=gen) * 3).to(dtype=dtype, device=device)
    ref = silu_and_mul_ref(x.float()).to(dtype)  # float32 math, one rounding, as the kernel
    close(silu_and_mul(x), ref, dtype)
    assert silu_and_mul(x).shape == (t, inter)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("t,inter", [(1, 48), (5, 1100), (0, 64)])
def test_silu_and_mul(t, inter, dtype, gen, device, close):
    if t == 0:
        from kernels.triton_act import silu_and_mul

        assert silu_and_mul(torch.zeros(0, 2 * inter, device=device)).shape == (0, inter)
        return
    _case(t, inter, dtype, gen, device, close)


def test_silu_and_mul_reference_is_the_unfused_formula(gen):
    x = torch.randn(3, 20, generator=gen)
    gate, up = x[:, :10], x[:, 10:]
    torch.testing.assert_close(silu_and_mul_ref(x), torch.nn.functional.silu(gate) * up)


def test_silu_and_mul_rejects_odd_width(device):
    from kernels.triton_act import silu_and_mul

    with pytest.raises(ValueError, match="x: expected"):
        silu_and_mul(torch.zeros(2, 5, device=device))


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_silu_and_mul_gpu(dtype, gen, close):
    _case(300, 14336, dtype, gen, torch.device("cuda"), close)
