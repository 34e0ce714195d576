"""The MoE down + sum launch with the next layer's residual add + RMSNorm inside it
(kernels/triton_moe_down_sum.py's next_norm, through kernels/triton_moe.fused_moe_next_norm)
against down_sum then kernels/triton_norm.rms_norm: the same normed row and new residual
bit for bit (rms_norm's own jit helpers do the arithmetic), the per-token counters back at
zero after every launch, one launch fewer, and the arguments checked. The engine's use of
it (engine.models.moe.NEXT_NORM_FUSED) is tested in tests/kernels/test_moe_next_norm_engine.py.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()

# (h, inter, e_local, start, k, shared): H off the 16-column tiles (the last program's
# columns wrap), I off the K tile, shared experts among the pairs (ids past the routed
# ones, weight 1), and a rank holding part of the experts (its other pairs add nothing)
SHAPES = [
    (40, 64, 8, 0, 3, 2),  # H = 40: three column programs, the last one partly past H
    (48, 40, 5, 4, 3, 1),  # this rank: routed experts 4-7 and the shared one (id 8)
    (32, 48, 8, 0, 2, 0),  # I = 48: a 32-column K tile, then one moved back by 16
    (200, 32, 4, 0, 4, 0),  # experts 0-3 of 8: the other rank's pairs skipped; 13 programs
]


def _inputs(h: int, inter: int, e_local: int, start: int, k: int, shared: int, t: int,
            dtype: torch.dtype, gen: torch.Generator, device: torch.device
            ) -> dict[str, Any]:
    """down_sum's arguments for t tokens routed to k of 8 routed experts plus `shared`
    always-on ones, and the next norm's weight and residual."""
    routed = torch.stack([torch.randperm(8, generator=gen)[:k] for _ in range(t)])
    ids = torch.cat([routed, torch.arange(8, 8 + shared).expand(t, shared)], dim=1)
    weights = torch.cat([torch.rand(t, k, generator=gen), torch.ones(t, shared)], dim=1)
    n = k + shared
    act = torch.randn(t * n, inter, generator=gen)
    w2 = torch.randn(e_local, h, inter, generator=gen) * inter**-0.5
    return dict(act=act.to(device, dtype), w2=w2.to(device, dtype),
                topk_ids=ids.to(device), topk_weights=weights.to(device),
                expert_start=start,
                norm_weight=(1 + 0.1 * torch.randn(h, generator=gen)).to(device, dtype),
                residual=torch.randn(t, h, generator=gen).to(device, dtype))


def _fused(a: dict[str, Any], eps: float = 1e-6) -> tuple[torch.Tensor, torch.Tensor]:
    from kernels.triton_moe_down_sum import down_sum

    t, h = a["residual"].shape
    out = torch.empty(t, h, dtype=a["act"].dtype, device=a["act"].device)
    got = down_sum(a["act"], a["w2"], a["topk_ids"], a["topk_weights"], out,
                   a["expert_start"], a.get("w2_scale"),
                   next_norm=(a["norm_weight"], eps, a["residual"]))
    assert got is not None and got[1] is out  # out receives the new residual
    return got


def _unfused(a: dict[str, Any], eps: float = 1e-6) -> tuple[torch.Tensor, torch.Tensor]:
    from kernels.triton_moe_down_sum import down_sum
    from kernels.triton_norm import rms_norm

    t, h = a["residual"].shape
    out = torch.empty(t, h, dtype=a["act"].dtype, device=a["act"].device)
    assert down_sum(a["act"], a["w2"], a["topk_ids"], a["topk_weights"], out,
                    a["expert_start"], a.get("w2_scale")) is None
    return rms_norm(out, a["norm_weight"], eps, a["residual"])


def _assert_same(got: tuple[torch.Tensor, torch.Tensor],
                 want: tuple[torch.Tensor, torch.Tensor]) -> None:
    for g, w, name in zip(got, want, ("normed", "new_residual"), strict=True):
        assert g.dtype == w.dtype and g.shape == w.shape, name
        assert torch.isfinite(g).all(), f"{name}: an element was not written"
        assert torch.equal(g, w), f"{name}: {(g.float() - w.float()).abs().max()}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("h,inter,e_local,start,k,shared", SHAPES)
def test_next_norm_equals_down_sum_then_rms_norm(h, inter, e_local, start, k, shared, dtype,
                                                 gen, device):
    from kernels.triton_moe_down_sum import counters

    a = _inputs(h, inter, e_local, start, k, shared, 1, dtype, gen, device)
    want = _unfused(a)
    got = _fused(a)
    _assert_same(got, want)
    assert not counters(device, 1).any()  # the last program reset its token's counter
    # and a second launch, the counters found at zero, is the same again
    _assert_same(_fused(a), want)


def test_next_norm_tokens_int32_ids_and_eps(gen, device):
    # a grid row per token, each with its own counter; int32 ids; another eps
    from kernels.triton_moe_down_sum import counters

    a = _inputs(40, 32, 8, 0, 2, 1, 3, torch.bfloat16, gen, device)
    a["topk_ids"] = a["topk_ids"].to(torch.int32)
    _assert_same(_fused(a, eps=1e-2), _unfused(a, eps=1e-2))
    assert not counters(device, 3).any()


def test_next_norm_fp8_experts(gen, device):
    # per-channel and block scales, as fused_moe passes them
    from kernels.ref_fp8 import quantize_stack

    for block in (None, (16, 16)):
        a = _inputs(48, 64, 8, 0, 3, 1, 1, torch.bfloat16, gen, device)
        q2, s2 = quantize_stack(a["w2"].float().cpu(), block)
        a.update(w2=q2.to(device), w2_scale=s2.to(device))
        _assert_same(_fused(a), _unfused(a))


def test_next_norm_many_k_tiles(gen, device, monkeypatch):
    import kernels.triton_moe_down_sum as ds

    monkeypatch.setattr(ds, "BLOCK_K", 16)  # several K tiles a pair, a moved-back last one
    a = _inputs(40, 40, 8, 0, 3, 1, 1, torch.float32, gen, device)
    _assert_same(_fused(a), _unfused(a))


def test_next_norm_counters_are_the_kernels_own(gen, device):
    # router_route's counters are another buffer (kernels/last_program.py: a pool each)
    from kernels.triton_moe_down_sum import counters
    from kernels.triton_router_route import counters as route_counters

    a = _inputs(40, 32, 8, 0, 2, 0, 1, torch.float32, gen, device)
    _fused(a)
    buf = counters(device, 1)
    assert buf is not route_counters(device, 1)
    assert counters(device, 1) is buf and not buf.any()


def _moe_args(t: int, dtype: torch.dtype, gen: torch.Generator, device: torch.device,
              fp8: bool = False) -> dict[str, Any]:
    from kernels.ref_fp8 import quantize_stack

    h, inter, e, k = 40, 32, 9, 3
    w13 = torch.randn(e, 2 * inter, h, generator=gen) * h**-0.5
    w2 = torch.randn(e, h, inter, generator=gen) * inter**-0.5
    a: dict[str, Any] = dict(
        x=torch.randn(t, h, generator=gen).to(device, dtype),
        topk_weights=torch.rand(t, k, generator=gen).to(device),
        topk_ids=torch.stack([torch.randperm(e, generator=gen)[:k] for _ in range(t)]
                             ).to(device),
        expert_start=0)
    if fp8:
        q13, s13 = quantize_stack(w13, None)
        q2, s2 = quantize_stack(w2, None)
        a.update(w13=q13.to(device), w2=q2.to(device), w13_scale=s13.to(device),
                 w2_scale=s2.to(device))
    else:
        a.update(w13=w13.to(device, dtype), w2=w2.to(device, dtype))
    return a


@pytest.mark.parametrize("fp8", [False, True])
def test_fused_moe_next_norm_saves_the_norm_launch(fp8, gen, device, monkeypatch):
    import kernels.triton_moe as m
    from kernels.triton_norm import rms_norm
    from tests.kernels.test_moe_down_sum import _launches

    monkeypatch.setattr(m, "DOWN_SUM_MAX_TOKENS", 1)
    a = _moe_args(1, torch.bfloat16, gen, device, fp8)
    nw = (1 + 0.1 * torch.randn(40, generator=gen)).to(device, torch.bfloat16)
    res = torch.randn(1, 40, generator=gen).to(device, torch.bfloat16)
    with _launches() as off:
        want = rms_norm(m.fused_moe(**a), nw, 1e-5, res)
    with _launches() as on:
        got = m.fused_moe_next_norm(**a, norm_weight=nw, eps=1e-5, residual=res)
    assert got is not None
    _assert_same(got, want)
    assert on == {"_gate_up_kernel": 1, "_down_sum_kernel": 1}, on
    assert sum(on.values()) == sum(off.values()) - 1, off


def test_fused_moe_next_norm_declines_where_down_sum_does_not_run(gen, device, monkeypatch):
    # the switch off, or two tokens (the align step's layout): None, nothing launched
    import kernels.triton_moe as m
    from tests.kernels.test_moe_down_sum import _launches

    nw = torch.ones(40, device=device)
    for tokens, bound in ((1, 0), (2, 2)):
        monkeypatch.setattr(m, "DOWN_SUM_MAX_TOKENS", bound)
        a = _moe_args(tokens, torch.float32, gen, device)
        with _launches() as counts:
            got = m.fused_moe_next_norm(**a, norm_weight=nw, eps=1e-6,
                                        residual=torch.zeros(tokens, 40, device=device))
        assert got is None and not counts, counts


def test_next_norm_bad_arguments_are_refused(device):
    from kernels.triton_moe_down_sum import down_sum
    from tests.kernels.test_moe_down_sum import _valid_args

    act, w2, ids, wts, out = _valid_args(device)
    nw, res = torch.ones(16, device=device), torch.zeros(2, 16, device=device)

    def call(nw: torch.Tensor = nw, res: torch.Tensor = res) -> Any:
        return down_sum(act, w2, ids, wts, out, next_norm=(nw, 1e-6, res))

    with pytest.raises(ValueError, match=r"next_norm weight: expected shape \(16,\)"):
        call(nw=nw[:8])
    with pytest.raises(ValueError, match="next_norm weight: dtype torch.int64 is not one of"):
        call(nw=nw.long())
    with pytest.raises(ValueError, match="next_norm weight: must be contiguous"):
        call(nw=torch.ones(16, 2, device=device)[:, 0])
    with pytest.raises(ValueError, match=r"next_norm residual: expected shape \(2, 16\)"):
        call(res=res[:1])
    with pytest.raises(ValueError, match="next_norm residual: expected out's dtype"):
        call(res=res.bfloat16())
    with pytest.raises(ValueError, match="next_norm residual: rows must be contiguous"):
        call(res=torch.zeros(16, 2, device=device).t())
    # no tokens: nothing launched, empty results
    got = down_sum(act[:0], w2, ids[:0], wts[:0], out[:0], next_norm=(nw, 1e-6, res[:0]))
    assert got is not None and got[0].shape == (0, 16) and got[1].shape == (0, 16)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU: graph replays at real sizes")
@pytest.mark.parametrize("h,inter,k,shared", [(2048, 1408, 6, 2), (7168, 2048, 8, 1)])
@pytest.mark.parametrize("fp8", [False, True])
def test_gpu_graph_replays_equal_down_sum_then_rms_norm(h, inter, k, shared, fp8, gen):
    """The race itself, on hardware, at V2-Lite's and V3's shapes (bf16 experts and FP8
    per channel): many launches back to back in a captured graph (every "layer" sharing
    the counters, launched with PDL where the GPU has it, as fused_moe launches them),
    replayed with fresh inputs, each normed row bit-equal to rms_norm's of its new
    residual, the rstd included (rms_norm's warps: the same order of the row's sum of
    squares), and the new residual bit-equal to down_sum's + the residual where the
    launch's warps keep the weight tile's layout (kernels/triton_moe_down_sum.py's
    docstring: all but FP8 at H = 7168, 16 warps; there, within a last bit of each pair's
    rounded row, weighted, and of the MoE row and the sum), the counters back at zero."""
    from kernels.pdl import pdl_for
    from kernels.ref_fp8 import dequant_stack, quantize_stack
    from kernels.triton_moe_down_sum import counters, down_sum
    from kernels.triton_norm import rms_norm

    dev = torch.device("cuda")
    layers, e, n, eps = 24, k + shared + 4, k + shared, 1e-6
    w2f = torch.randn(e, h, inter, generator=gen) * inter**-0.5  # one weight for all
    scale = None
    if fp8:
        q2, s2 = quantize_stack(w2f, None)
        w2, scale = q2.to(dev), s2.to(dev)
        w2dq = dequant_stack(q2, s2).to(dev)  # the weight the pairs' rows are products of
    else:
        w2 = w2f.to(dev, torch.bfloat16)
    act = torch.randn(layers, n, inter, generator=gen).to(dev, torch.bfloat16)
    res = (torch.randn(layers, 1, h, generator=gen) * 4).to(dev, torch.bfloat16)
    nw = (1 + 0.3 * torch.randn(layers, h, generator=gen)).to(dev, torch.bfloat16)
    ids = torch.stack([torch.cat([torch.randperm(e - shared, generator=gen)[:k],
                                  torch.arange(e - shared, e)]) for _ in range(layers)]
                      ).view(layers, 1, n).to(dev)
    wts = torch.cat([torch.rand(layers, 1, k, generator=gen), torch.ones(layers, 1, shared)],
                    dim=2).to(dev)
    pdl = pdl_for(act)
    exact = not (fp8 and h == 7168)

    def fused(i: int) -> tuple[torch.Tensor, torch.Tensor]:
        out = torch.empty(1, h, dtype=torch.bfloat16, device=dev)
        got = down_sum(act[i], w2, ids[i], wts[i], out, 0, scale, pdl, (nw[i], eps, res[i]))
        assert got is not None
        return got

    def unfused(i: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        out = torch.empty(1, h, dtype=torch.bfloat16, device=dev)
        down_sum(act[i], w2, ids[i], wts[i], out, 0, scale, pdl)
        return (*rms_norm(out, nw[i], eps, res[i]), out)

    fused(0)  # compiles, and allocates the counters outside the capture
    unfused(0)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = [fused(i) for i in range(layers)]
    for step in range(20):
        act.copy_(torch.randn(layers, n, inter, generator=gen).to(dev, torch.bfloat16))
        res.copy_((torch.randn(layers, 1, h, generator=gen) * 4).to(dev, torch.bfloat16))
        graph.replay()
        for i in range(layers):
            normed, new_res = outs[i]
            assert torch.equal(normed, rms_norm(new_res, nw[i], eps)[0]), (step, i)
            want = unfused(i)
            if exact:
                assert torch.equal(new_res, want[1]), (step, i)
                assert torch.equal(normed, want[0]), (step, i)
            else:
                # Each pair's row is rounded to bf16 before it is weighted and added
                # (kernels/triton_moe_down_sum.py), and its float32 sum over K runs in
                # another order here: a pair's row may round the other way, by an ulp of
                # that row (<= 2^-7 of it) times its weight. Where the pairs cancel, that
                # is far more than an ulp of the MoE row or of the new residual (H100 runs
                # of sessions 36 and 37 met such columns at this shape); then the MoE row's
                # and the new residual's own roundings. new_res itself is each program's
                # own columns, read by no other program: a race could reach only the
                # normed row, which is checked bit for bit above.
                rows = torch.einsum("pi,phi->ph", act[i].float(), w2dq[ids[i][0]])
                pairs = (rows.abs() * wts[i][0].view(-1, 1)).sum(0, keepdim=True)
                bound = (pairs + want[2].float().abs() + want[1].float().abs()) * 2.0**-7
                diff = (new_res.float() - want[1].float()).abs()
                assert (diff <= 1.01 * bound).all(), (step, i, (diff / bound).max())
    torch.cuda.synchronize()
    assert not counters(dev, 1).any()
