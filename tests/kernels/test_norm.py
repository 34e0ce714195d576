"""Triton RMSNorm and RoPE against the torch references."""

from __future__ import annotations

import math

import pytest
import torch

from kernels.ref_norm import rms_norm_ref, rope_ref

HAS_CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def _norm_case(t, h, dtype, with_res, gen, device, close):
    from kernels.triton_norm import rms_norm
    x = (3 * torch.randn(t, h, generator=gen)).to(dtype=dtype, device=device)
    w = (1 + 0.1 * torch.randn(h, generator=gen)).to(dtype=dtype, device=device)
    res = torch.randn(t, h, generator=gen).to(dtype=dtype, device=device) if with_res else None
    x_before = x.clone()
    out, new_res = rms_norm(x, w, 1e-5, res)
    ref_out, ref_res = rms_norm_ref(x, w, 1e-5, res)
    close(out, ref_out, dtype)
    close(new_res, ref_res, dtype)
    assert torch.equal(x, x_before)  # inputs are not modified
    if res is None:
        assert new_res is x


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_res", [False, True])
@pytest.mark.parametrize("h", [64, 96])  # 96: a hidden size that is no power of two
def test_rms_norm(dtype, with_res, h, gen, device, close):
    _norm_case(7, h, dtype, with_res, gen, device, close)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_gpu(dtype, gen, close):
    _norm_case(4096, 4096, dtype, True, gen, torch.device("cuda"), close)


def _cos_sin(max_pos: int, d: int, device: torch.device) -> torch.Tensor:
    inv_freq = 1.0 / (500000.0 ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    ang = torch.arange(max_pos, dtype=torch.float64)[:, None] * inv_freq[None, :]
    return torch.cat((ang.cos(), ang.sin()), dim=-1).float().to(device)  # [max_pos, D]


def _rope_case(t, hq, hkv, d, dtype, gen, device, close):
    from kernels.triton_norm import rope
    qkv = torch.randn(t, hq + 2 * hkv, d, generator=gen).to(dtype=dtype, device=device)
    q, k = qkv[:, :hq], qkv[:, hq:hq + hkv]  # strided views, as from a fused projection
    positions = torch.randint(0, 1000, (t,), generator=gen).to(device)
    cs = _cos_sin(1000, d, device)
    q_out, k_out = rope(q, k, positions, cs)
    q_ref, k_ref = rope_ref(q, k, positions, cs)
    close(q_out, q_ref, dtype)
    close(k_out, k_ref, dtype)
    # Rotation keeps each pair's norm: a check that does not lean on the reference.
    assert math.isclose(float(q_out.float().norm()), float(q.float().norm()), rel_tol=1e-2)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hq,hkv,d", [(4, 4, 64), (6, 2, 128), (8, 1, 64)])
def test_rope(dtype, hq, hkv, d, gen, device, close):
    _rope_case(5, hq, hkv, d, dtype, gen, device, close)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_gpu(dtype, gen, close):
    _rope_case(8192, 32, 8, 128, dtype, gen, torch.device("cuda"), close)
