"""The MLA step's latent kernel (RMSNorm + RoPE + latent store + the queries' RoPE in one
launch) against its torch reference, which is the separate references composed: the
cache rows and the rotated queries hold the same bits."""

from __future__ import annotations

import pytest
import torch

from kernels.kv_fp8 import FP8_DTYPE
from kernels.ref_kv import store_latent_ref
from kernels.ref_mla_latent import mla_latent_store_ref
from kernels.ref_norm import rms_norm_ref, rope_ref


def _inputs(t: int, heads: int, c: int, r: int, dn: int, dtype: torch.dtype,
            gen: torch.Generator, device: torch.device, kv_dtype: torch.dtype | None = None):
    bs, nb = 4, 2 * t + 2
    # kv_a as a column slice of a wider projection output: strided rows, as a fused GEMM
    # leaves them
    wide = torch.randn(t, c + r + 8, generator=gen).to(dtype)
    kv_a = wide[:, 8:]
    q = torch.randn(t, heads, dn + r, generator=gen).to(dtype)
    w = (torch.rand(c, generator=gen) + 0.5).to(dtype)
    pos = torch.randint(0, 60, (t,), generator=gen)
    cs = torch.randn(64, r, generator=gen)
    kv = torch.zeros(nb, 1, bs, 1, c + r, dtype=kv_dtype or dtype)
    slots = torch.randperm(nb * bs, generator=gen)[:t]
    if t > 1:
        slots[0] = -1  # a padding row: its queries are still rotated, nothing is stored
    return [x.to(device) for x in (kv_a, q, w, pos, cs, kv, slots)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("t,heads", [(1, 4), (5, 3)])
def test_mla_latent_store_equals_reference(dtype, t, heads, gen, device):
    from kernels.triton_mla_latent import mla_latent_store

    kv_a, q, w, pos, cs, kv, slots = _inputs(t, heads, 32, 16, 8, dtype, gen, device)
    q_ref, kv_ref = q.clone(), kv.clone()
    mla_latent_store_ref(kv_a, q_ref, w, 1e-6, pos, cs, kv_ref, slots)
    mla_latent_store(kv_a, q, w, 1e-6, pos, cs, kv, slots)
    tol = 0 if dtype == torch.float32 else 1e-2  # the interpreter's bf16 cast truncates
    torch.testing.assert_close(q, q_ref, rtol=tol, atol=tol or 1e-6)
    torch.testing.assert_close(kv, kv_ref, rtol=tol, atol=tol or 1e-6)
    assert kv.float().abs().sum() > 0  # rows were written


def test_rotated_queries_can_go_to_another_tensor(gen, device):
    """q_pe_out: the rotated rope parts land there (the absorbed query's rope columns), q
    is left as it was."""
    from kernels.triton_mla_latent import mla_latent_store

    kv_a, q, w, pos, cs, kv, slots = _inputs(3, 4, 32, 16, 8, torch.float32, gen, device)
    q0, q_ref, kv_ref = q.clone(), q.clone(), kv.clone()
    mla_latent_store_ref(kv_a, q_ref, w, 1e-6, pos, cs, kv_ref, slots)
    for fn in (mla_latent_store, mla_latent_store_ref):
        dest = torch.zeros(3, 4, 32 + 16, device=device)
        fn(kv_a, q, w, 1e-6, pos, cs, kv, slots, q_pe_out=dest[..., 32:])
        assert torch.equal(q, q0)
        torch.testing.assert_close(kv, kv_ref, rtol=0, atol=1e-6)
        torch.testing.assert_close(dest[..., 32:], q_ref[..., 8:], rtol=0, atol=1e-6)
        assert torch.equal(dest[..., :32], torch.zeros_like(dest[..., :32]))


def test_the_reference_is_the_separate_kernels_composed(gen):
    kv_a, q, w, pos, cs, kv, slots = _inputs(6, 4, 32, 16, 8, torch.float32, gen,
                                             torch.device("cpu"))
    q0 = q.clone()
    mla_latent_store_ref(kv_a, q, w, 1e-6, pos, cs, kv, slots)
    normed = rms_norm_ref(kv_a[:, :32].contiguous(), w, 1e-6)[0]
    q_pe, k_pe = rope_ref(q0[..., 8:].contiguous(), kv_a[:, None, 32:].contiguous(), pos, cs)
    want = torch.zeros_like(kv)
    store_latent_ref(torch.cat([normed, k_pe[:, 0]], dim=-1), want, slots)
    assert torch.equal(kv, want)
    assert torch.equal(q[..., 8:], q_pe) and torch.equal(q[..., :8], q0[..., :8])
    assert torch.equal(kv.view(-1, 48)[slots[1:]], want.view(-1, 48)[slots[1:]])


def test_fp8_cache_rows_are_scaled(gen, device):
    from kernels.triton_mla_latent import mla_latent_store

    kv_a, q, w, pos, cs, kv, slots = _inputs(3, 2, 32, 16, 8, torch.float32, gen, device,
                                             kv_dtype=FP8_DTYPE)
    q_ref, kv_ref = q.clone(), kv.clone()
    mla_latent_store_ref(kv_a, q_ref, w, 1e-6, pos, cs, kv_ref, slots, scale=0.25)
    mla_latent_store(kv_a, q, w, 1e-6, pos, cs, kv, slots, scale=0.25)
    # bit-equal on the GPU; Triton's interpreter drops the carry when the e4m3 rounding
    # overflows the mantissa (1.99 -> 1.0), so there a few entries are a factor 2 apart
    same = (kv.cpu().view(torch.uint8) == kv_ref.cpu().view(torch.uint8)).float().mean()
    assert same.item() > (0.999 if torch.cuda.is_available() else 0.9), same
    got, want = kv.cpu().float() * 0.25, kv_ref.cpu().float() * 0.25
    assert torch.allclose(got, want, rtol=0.51, atol=0.25 * 2.0 ** -8)
    assert want.abs().sum() > 0


def test_bad_shapes_name_the_field(device):
    from kernels.triton_mla_latent import mla_latent_store

    kv_a = torch.zeros(2, 48, device=device)
    q = torch.zeros(2, 4, 24, device=device)
    kv = torch.zeros(4, 1, 4, 1, 48, device=device)
    ok = dict(positions=torch.zeros(2, dtype=torch.int64, device=device),
              cos_sin=torch.zeros(8, 16, device=device), kv_layer=kv,
              slot_mapping=torch.zeros(2, dtype=torch.int64, device=device))
    with pytest.raises(ValueError, match="norm_weight"):
        mla_latent_store(kv_a, q, torch.zeros(31, device=device), 1e-6, **ok)
    with pytest.raises(ValueError, match="slot_mapping"):
        mla_latent_store(kv_a, q, torch.zeros(32, device=device), 1e-6,
                         **{**ok, "slot_mapping": torch.zeros(3, dtype=torch.int64,
                                                              device=device)})
