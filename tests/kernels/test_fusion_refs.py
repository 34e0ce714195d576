"""The torch references of the small-batch decode fusions against their Triton kernels:
router logits + routing (kernels/triton_router_route.py), down + top-k sum
(triton_moe_down_sum.py), the MLA latent kernel + W_UK product
(triton_mla_latent_absorb.py) and the split merge inside the W_UV product
(triton_mla_up_merge.py). Each reference has its kernel's signature (the kernels/ rule)
and is built from the references of the kernels the fusion replaced."""

from __future__ import annotations

import pytest
import torch

from tests.kernels.test_mla_latent_absorb import _inputs as latent_inputs
from tests.kernels.test_mla_up_merge import _inputs as up_merge_inputs


def _dense(weights: torch.Tensor, ids: torch.Tensor, width: int) -> torch.Tensor:
    """A routing as a [T, width] weight matrix: the kernels and the reference may list a
    token's chosen experts in another order."""
    return torch.zeros(ids.shape[0], width, dtype=torch.float32,
                       device=ids.device).scatter_(1, ids.long(), weights.float())


@pytest.mark.parametrize("scoring,bias,groups", [("softmax", False, None),
                                                 ("sigmoid", True, (4, 2))])
@pytest.mark.parametrize("t", [1, 5])
def test_router_route_ref(scoring, bias, groups, t, gen, device):
    from kernels.ref_moe import router_route_ref
    from kernels.triton_router_route import router_route

    e, h = 24, 200  # neither a multiple of its tile
    x = torch.randn(t, h, generator=gen).to(device=device, dtype=torch.bfloat16)
    w = (torch.randn(e, h, generator=gen) * 0.1).to(device)
    kw = dict(top_k=3, scoring_func=scoring, renormalize=bias, routed_scaling_factor=2.0,
              e_score_correction_bias=(torch.randn(e, generator=gen) * 0.1).to(device)
              if bias else None, num_shared=2, n_group=groups[0] if groups else None,
              topk_group=groups[1] if groups else None)
    got = router_route(x, w, torch.float32, **kw)
    want = router_route_ref(x, w, torch.float32, **kw)
    assert got[0].shape == want[0].shape == (t, 5)
    torch.testing.assert_close(_dense(*got, e + 2), _dense(*want, e + 2), rtol=1e-5,
                               atol=1e-6)


@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_down_sum_ref(fp8, dtype, gen, device, close):
    from kernels.ref_fp8 import quantize_stack
    from kernels.ref_moe import down_sum_ref
    from kernels.triton_moe_down_sum import down_sum

    t, k, e, h, inter = 2, 4, 6, 40, 48
    act = torch.randn(t * k, inter, generator=gen).to(device=device, dtype=dtype)
    w2 = (torch.randn(e, h, inter, generator=gen) * 0.1).to(device=device, dtype=dtype)
    scale = None
    if fp8:  # per output channel
        w2, scale = quantize_stack(w2.float())
    # experts 2..5 are this rank's (expert_start 2): slots routed to 0 and 1 add nothing
    ids = torch.tensor([[0, 3, 5, 2], [4, 1, 2, 7]], device=device)
    weights = torch.rand(t, k, generator=gen).to(device)
    got = torch.full((t, h), float("nan"), dtype=dtype, device=device)
    want = torch.full_like(got, float("nan"))
    down_sum(act, w2, ids, weights, got, expert_start=2, w2_scale=scale)
    down_sum_ref(act, w2, ids, weights, want, expert_start=2, w2_scale=scale)
    close(got, want, dtype)


@pytest.mark.parametrize("kv", [torch.float32, torch.float8_e4m3fn])
def test_mla_latent_absorb_ref(kv, gen, device, close):
    from kernels.ref_mla_latent import mla_latent_absorb_ref
    from kernels.triton_mla_latent_absorb import mla_latent_absorb

    c = 40
    a = latent_inputs(3, 4, 24, 8, c, 20, torch.float32, kv, gen, device)
    runs = []
    for fn in (mla_latent_absorb, mla_latent_absorb_ref):
        buf, cache = a["buf"].clone(), a["kv_layer"].clone()
        fn(a["kv_a"], a["q"].clone(), a["norm_weight"], a["eps"], a["positions"],
           a["cos_sin"], cache, a["slot_mapping"], a["q_nope"], a["w_uk"], buf[..., :c],
           scale=0.5, q_pe_out=buf[..., c:buf.shape[-1] - 8])
        runs.append((buf, cache))
    (buf, cache), (ref_buf, ref_cache) = runs
    close(buf[..., :-8], ref_buf[..., :-8], torch.float32)
    assert buf[..., -8:].isnan().all() and ref_buf[..., -8:].isnan().all()  # untouched
    written = a["slot_mapping"][a["slot_mapping"] >= 0]
    rows = lambda t: t.view(-1, t.shape[-1])[written].float()  # noqa: E731
    close(rows(cache), rows(ref_cache), torch.float32)


@pytest.mark.parametrize("kw", [{"num_splits": 3, "max_seq_len": 129}, {}, {"num_splits": 1,
                                                                           "max_seq_len": 129}])
def test_mla_up_v_merged_ref(kw, gen, device, close):
    from kernels.ref_mla_decode import mla_up_v_merged_ref
    from kernels.triton_mla_decode import mla_decode_unmerged
    from kernels.triton_mla_up_merge import mla_up_v_merged

    lens = [70, 0, 129]  # a graph's padding row (no context): zeros
    q, cache, table, seq_lens, w_uv = up_merge_inputs(lens, 4, 32, 16, 20, torch.float32,
                                                      gen, device)
    d = mla_decode_unmerged(q, cache, table, seq_lens, 0.2, 32, block_n=16, **kw)
    got = mla_up_v_merged(d, seq_lens, w_uv, torch.empty(3, 4, 20, device=device))
    want = mla_up_v_merged_ref(d, seq_lens, w_uv, torch.empty(3, 4, 20, device=device))
    close(got, want, torch.float32)
    assert torch.equal(want[1], torch.zeros_like(want[1]))


@pytest.mark.parametrize("parts", [0, 2])
def test_router_route_prenorm_ref(parts, gen, device, close):
    # the residual add + RMSNorm before the routing, from a row or split-K partial sums
    from kernels.ref_moe import router_route_prenorm_ref
    from kernels.triton_router_route import router_route_prenorm

    t, e, h = 3, 20, 96
    x = (torch.randn(parts, t, h, generator=gen) if parts
         else torch.randn(t, h, generator=gen)).to(device)
    res = torch.randn(t, h, generator=gen).to(device)
    nw = (1 + 0.3 * torch.randn(h, generator=gen)).to(device)
    w = (torch.randn(e, h, generator=gen) * 0.1).to(device)
    args = (x, res, nw, 1e-6, w, torch.float32, 4, "softmax", True)
    got, want = router_route_prenorm(*args), router_route_prenorm_ref(*args)
    torch.testing.assert_close(_dense(*got[:2], e), _dense(*want[:2], e), rtol=1e-5,
                               atol=1e-6)
    close(got[2], want[2], torch.float32)
    close(got[3], want[3], torch.float32)


def test_down_sum_next_norm_ref(gen, device, close):
    # the next layer's input norm in the same launch: out holds the new residual
    from kernels.ref_moe import down_sum_ref
    from kernels.triton_moe_down_sum import down_sum

    t, k, e, h, inter = 1, 4, 6, 40, 48
    act = torch.randn(t * k, inter, generator=gen).to(device)
    w2 = (torch.randn(e, h, inter, generator=gen) * 0.1).to(device)
    ids = torch.tensor([[0, 3, 5, 2]], device=device)
    weights = torch.rand(t, k, generator=gen).to(device)
    norm = ((1 + 0.3 * torch.randn(h, generator=gen)).to(device), 1e-6,
            torch.randn(t, h, generator=gen).to(device))
    got_out, want_out = torch.empty(t, h, device=device), torch.empty(t, h, device=device)
    got = down_sum(act, w2, ids, weights, got_out, next_norm=norm)
    want = down_sum_ref(act, w2, ids, weights, want_out, next_norm=norm)
    assert got is not None and want is not None
    close(got[0], want[0], torch.float32)
    close(got_out, want_out, torch.float32)  # the new residual
    assert got[1] is got_out and want[1] is want_out


@pytest.mark.parametrize("fp8", [False, True])
def test_gate_up_gemv_ref(fp8, gen, device, close):
    from kernels.ref_fp8 import quantize_stack
    from kernels.ref_moe import gate_up_gemv_ref
    from kernels.triton_moe_gate_up_gemv import gate_up_gemv

    t, k, e, h, inter = 1, 3, 6, 40, 24
    x = torch.randn(t, h, generator=gen).to(device)
    w13 = (torch.randn(e, 2 * inter, h, generator=gen) * 0.1).to(device)
    scale = None
    if fp8:
        w13, scale = quantize_stack(w13)
    ids = torch.tensor([[3, 0, 5]], device=device)  # expert 0 is another rank's (start 1)
    got = torch.full((t * k, inter), float("nan"), device=device)
    want = got.clone()
    gate_up_gemv(x, w13[1:], got, ids, expert_start=1,
                 w13_scale=None if scale is None else scale[1:])
    gate_up_gemv_ref(x, w13[1:], want, ids, expert_start=1,
                     w13_scale=None if scale is None else scale[1:])
    close(got[[0, 2]], want[[0, 2]], torch.float32)
    assert got[1].isnan().all() and want[1].isnan().all()  # another rank's row: unwritten
