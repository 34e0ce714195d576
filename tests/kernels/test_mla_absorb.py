"""MLA decode's per-head products as Triton kernels (kernels/triton_mla_absorb.py) against
torch.bmm on the same strided views engine/models/mla.py hands them: W_UK and W_UV as views
of kv_b_proj's weight, the absorbed query's first C columns as the output."""

from __future__ import annotations

import pytest
import torch


def _views(h, dn, dv, c, gen, device, dtype):  # type: ignore[no-untyped-def]
    w = torch.randn(h * (dn + dv), c, generator=gen).to(device=device, dtype=dtype) * 0.1
    w3 = w.view(h, dn + dv, c)
    return w3[:, :dn], w3[:, dn:]


@pytest.mark.parametrize("b", [1, 3, 6])  # 6: two row groups, the second partial
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_products_equal_bmm_on_the_models_views(b, dtype, gen, device, close):
    from kernels.triton_mla_absorb import mla_absorb_q, mla_up_v

    h, dn, r, dv, c = 4, 24, 8, 20, 48  # widths under their powers of two: masked
    w_uk, w_uv = _views(h, dn, dv, c, gen, device, dtype)
    q = torch.randn(b, h, dn + r, generator=gen).to(device=device, dtype=dtype)
    q_nope = q[..., :dn]
    q_abs = torch.full((b, h, c + r), float("nan"), device=device, dtype=dtype)
    mla_absorb_q(q_nope, w_uk, q_abs[..., :c])
    ref = torch.bmm(q_nope.float().transpose(0, 1), w_uk.float()).transpose(0, 1)
    close(q_abs[..., :c], ref.to(dtype), dtype)
    assert torch.isnan(q_abs[..., c:]).all()  # the rope columns are the latent kernel's
    o_lat = torch.randn(b, h, c, generator=gen).to(device=device, dtype=dtype)
    o = torch.empty(b, h, dv, device=device, dtype=dtype)
    mla_up_v(o_lat, w_uv, o)
    ref = torch.bmm(o_lat.float().transpose(0, 1), w_uv.float().transpose(1, 2)).transpose(0, 1)
    close(o, ref.to(dtype), dtype)


def test_bad_shapes_name_the_argument(device):
    from kernels.triton_mla_absorb import mla_absorb_q

    w = torch.randn(2, 8, 16, device=device)
    with pytest.raises(ValueError, match="out: expected"):
        mla_absorb_q(torch.randn(1, 2, 8, device=device), w, torch.empty(1, 2, 8, device=device))
