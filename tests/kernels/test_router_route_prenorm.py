"""The PRENORM variant of the fused router launch (kernels/triton_router_route.py's
router_route_prenorm: the post-attention residual add + RMSNorm in the same launch,
from a row or a split-K projection's float32 partial sums) against
kernels/triton_norm.rms_norm then router_route, bit for bit; and in the engine
(engine.models.moe.ROUTER_PRENORM) one kernel fewer per MoE layer than the fused routing
alone."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.kernels.test_router_route import (
    HAS_CUDA,
    ROUTINGS,
    _decode_step,
    _switches,
    gpu_routing,
    graph_replays_equal,
)

# (x and residual dtype, router dtype, logits dtype, H): H a power of two nowhere, a
# multiple of the logits' 256-wide K tile once (768)
PRENORM_DTYPES = {"fp32": (torch.float32, torch.float32, torch.float32, 200),
                  "bf16_fp32_router": (torch.bfloat16, torch.float32, torch.float32, 768),
                  "bf16": (torch.bfloat16, torch.bfloat16, torch.bfloat16, 200)}


def _prenorm_inputs(routing: str, dtypes: str, t: int, gen: torch.Generator,
                    device: torch.device) -> tuple[Any, ...]:
    scoring, bias, renorm, scale, rnd, shared, ng, tg, e, k = ROUTINGS[routing]
    xd, wd, od, h = PRENORM_DTYPES[dtypes]
    x = torch.randn(t, h, generator=gen).to(device=device, dtype=xd)  # attention's output
    res = (torch.randn(t, h, generator=gen) * 4).to(device=device, dtype=xd)
    nw = (1 + 0.3 * torch.randn(h, generator=gen)).to(device=device, dtype=xd)
    w = (torch.randn(e, h, generator=gen) * 0.1).to(device=device, dtype=wd)
    b = torch.randn(e, generator=gen).to(device) * 0.1 if bias else None
    kw = dict(top_k=k, scoring_func=scoring, renormalize=renorm, routed_scaling_factor=scale,
              e_score_correction_bias=b, round_dtype=rnd, num_shared=shared, n_group=ng,
              topk_group=tg)
    return x, res, nw, 1e-6, w, od, kw


def _norm_then_route(x: torch.Tensor, res: torch.Tensor, nw: torch.Tensor, eps: float,
                     w: torch.Tensor, od: torch.dtype, kw: dict[str, Any]
                     ) -> tuple[torch.Tensor, ...]:
    from kernels.triton_norm import rms_norm
    from kernels.triton_router_route import router_route

    normed, new_res = rms_norm(x, nw, eps, res)
    return (*router_route(normed, w, od, **kw), normed, new_res)


@pytest.mark.parametrize("t", [1, 3, 16])
@pytest.mark.parametrize("dtypes", sorted(PRENORM_DTYPES))
@pytest.mark.parametrize("routing", sorted(ROUTINGS))
def test_prenorm_equals_rms_norm_then_router_route(routing, dtypes, t, gen, device):
    from kernels.triton_router_route import counters, router_route_prenorm

    x, res, nw, eps, w, od, kw = _prenorm_inputs(routing, dtypes, t, gen, device)
    x0, res0 = x.clone(), res.clone()
    got = router_route_prenorm(x, res, nw, eps, w, od, **kw)
    want = _norm_then_route(x, res, nw, eps, w, od, kw)
    names = ("weights", "ids", "normed", "new_residual")
    for name, a, b in zip(names, got, want, strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape, name
        assert torch.equal(a, b), name
    assert got[2].dtype == x.dtype and got[3].dtype == x.dtype
    assert torch.equal(x, x0) and torch.equal(res, res0)  # inputs not modified
    assert not counters(device, t).any()


@pytest.mark.parametrize("t", [1, 3])
@pytest.mark.parametrize("dtypes", sorted(PRENORM_DTYPES))
def test_prenorm_sums_a_split_k_projections_partials(dtypes, t, gen, device):
    # Qwen3-MoE's o_proj at few rows on one CUDA rank leaves [S, T, H] float32 partial
    # sums (engine/models/split_k.py) that rms_norm adds: the prenorm launch adds them too
    from kernels.triton_router_route import counters, router_route_prenorm

    x, res, nw, eps, w, od, kw = _prenorm_inputs("qwen3", dtypes, t, gen, device)
    parts = torch.randn(2, t, x.shape[1], generator=gen).to(device)
    got = router_route_prenorm(parts, res, nw, eps, w, od, **kw)
    want = _norm_then_route(parts, res, nw, eps, w, od, kw)
    for name, a, b in zip(("weights", "ids", "normed", "new_residual"), got, want,
                          strict=True):
        assert a.dtype == b.dtype and torch.equal(a, b), name
    assert got[2].dtype == res.dtype
    assert not counters(device, t).any()
    with pytest.raises(ValueError, match="x: partial sums must be float32"):
        router_route_prenorm(parts.half(), res, nw, eps, w, od, **kw)


def test_prenorm_no_tokens_and_bad_arguments(device):
    from kernels.triton_router_route import router_route_prenorm

    h = 48
    w = torch.randn(8, h, device=device)
    x, res, nw = torch.randn(2, h, device=device), torch.randn(2, h, device=device), \
        torch.ones(h, device=device)
    empty = torch.empty(0, h, device=device)
    weights, ids, normed, new_res = router_route_prenorm(empty, empty, nw, 1e-6, w,
                                                         torch.float32, 2, "softmax", True)
    assert weights.shape == ids.shape == (0, 2) and normed.shape == new_res.shape == (0, h)
    args = (torch.float32, 2, "softmax", True)
    with pytest.raises(ValueError, match="x, w: expected"):
        router_route_prenorm(x, res, nw, 1e-6, torch.randn(8, h + 1, device=device), *args)
    with pytest.raises(ValueError, match="residual: expected shape"):
        router_route_prenorm(x, res[:1], nw, 1e-6, w, *args)
    with pytest.raises(ValueError, match="residual: dtype"):
        router_route_prenorm(x, res.double(), nw, 1e-6, w, *args)
    with pytest.raises(ValueError, match="residual: rows"):
        router_route_prenorm(x, torch.randn(h, 2, device=device).t(), nw, 1e-6, w, *args)
    with pytest.raises(ValueError, match="norm_weight: expected shape"):
        router_route_prenorm(x, res, nw[1:], 1e-6, w, *args)
    with pytest.raises(ValueError, match="norm_weight: dtype"):
        router_route_prenorm(x, res, nw.long(), 1e-6, w, *args)
    with pytest.raises(ValueError, match="top_k"):
        router_route_prenorm(x, res, nw, 1e-6, w, torch.float32, 9, "softmax", True)


def _assert_prenorm_saves_the_norm(off: dict[str, Any], on: dict[str, Any],
                                   moe_layers: tuple[str, ...]) -> None:
    """on: each MoE layer's post-attention norm launch gone into its router's, all else
    equal; the dense layer unchanged."""
    assert on["layer.0"].total == off["layer.0"].total
    for layer in moe_layers:
        a, b = off[layer], on[layer]
        assert b.total == a.total - 1, (layer, a, b)
        assert b.triton["_rms_norm_kernel"] == a.triton["_rms_norm_kernel"] - 1, (layer, a, b)
        assert a.triton["_router_route_kernel"] == b.triton["_router_route_kernel"] == 1
        assert b.aten == a.aten


@pytest.mark.skipif(HAS_CUDA, reason="counts the interpreter's launches")
@pytest.mark.parametrize("version,batch", [("v2", 1), ("v3", 1), ("v3", 3)])
def test_engine_prenorm_gives_the_same_step_with_the_norm_launch_gone(version, batch,
                                                                      tmp_path, monkeypatch):
    from kernels.triton_router_route import MIN_COUNTERS, counters

    counters(torch.device("cpu"), MIN_COUNTERS)  # allocated before counting: not a step's
    off, off_logits = _decode_step(tmp_path, version, batch, True, monkeypatch)
    on, on_logits = _decode_step(tmp_path, version, batch, True, monkeypatch, prenorm=True)
    assert torch.equal(on_logits, off_logits)
    _assert_prenorm_saves_the_norm(off, on, ("layer.1", "layer.2"))
    # the MoE layer's norms: input_layernorm (and V3's q_a_layernorm) stay
    assert on["layer.1"].triton["_rms_norm_kernel"] == (1 if version == "v2" else 2)
    # without the fused routing there is no launch to hold the norm: the switch does nothing
    plain, plain_logits = _decode_step(tmp_path, version, batch, False, monkeypatch,
                                       prenorm=True)
    assert torch.equal(plain_logits, off_logits)
    assert plain["layer.1"].triton["_rms_norm_kernel"] == \
        off["layer.1"].triton["_rms_norm_kernel"]


@pytest.mark.skipif(HAS_CUDA, reason="counts the interpreter's launches")
def test_engine_prenorm_on_qwen3_moe(tmp_path, monkeypatch):
    # decode_op_count's Qwen3-MoE layout (GQA, q/k norms), its first layer dense here so
    # that _assert_prenorm_saves_the_norm has a layer the switch leaves alone
    from kernels.triton_router_route import MIN_COUNTERS, counters

    counters(torch.device("cpu"), MIN_COUNTERS)
    dense = dict(mlp_only_layers=[0])
    _decode_step(tmp_path, "qwen3", 2, True, monkeypatch, **dense)  # one-off buffers
    off, off_logits = _decode_step(tmp_path, "qwen3", 2, True, monkeypatch, **dense)
    on, on_logits = _decode_step(tmp_path, "qwen3", 2, True, monkeypatch, prenorm=True,
                                 **dense)
    assert torch.equal(on_logits, off_logits)
    _assert_prenorm_saves_the_norm(off, on, ("layer.1", "layer.2"))
    assert on["layer.1"].triton["_rms_norm_kernel"] == 1  # input_layernorm


def test_prenorm_is_refused_where_it_does_not_apply(monkeypatch):
    """forward_prenorm's None (the layer then runs the norm and the block): the switch
    off, the torch-reference kernel set, too many tokens, partial sums not in float32, an
    exchange (data-parallel attention)."""
    import engine.models.moe as moe
    from engine.attention import kernels_for
    from engine.config import MoEConfig
    from engine.models.llama import RMSNorm

    tri = kernels_for(torch.device("cuda"))
    cfg = MoEConfig(num_experts=8, top_k=2, intermediate_size=16, layers=(0,), renormalize=True)
    block = moe.SparseMoeBlock(cfg, 32, tri, None)
    norm = RMSNorm(32, 1e-6, tri)
    x = torch.randn(2, 32)
    _switches(monkeypatch, True, True)
    assert block._fused_route(2)
    # partial sums that are not float32 (a split-K projection's are)
    assert block.forward_prenorm(torch.randn(2, 2, 32).bfloat16(), x.bfloat16(), norm) is None
    assert block.forward_prenorm(torch.randn(moe.ROUTER_LOGITS_MAX_TOKENS + 1, 32),
                                 torch.randn(moe.ROUTER_LOGITS_MAX_TOKENS + 1, 32),
                                 norm) is None
    ref = moe.SparseMoeBlock(cfg, 32, kernels_for(torch.device("cpu")), None)
    assert ref.forward_prenorm(x, x, norm) is None
    block.exchange = object()  # type: ignore[assignment]
    assert block.forward_prenorm(x, x, norm) is None
    block.exchange = None
    _switches(monkeypatch, True, False)
    assert block.forward_prenorm(x, x, norm) is None
    _switches(monkeypatch, False, True)
    assert block.forward_prenorm(x, x, norm) is None


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("routing,e,h", [("v2_lite", 64, 2048), ("v3", 256, 7168)])
def test_gpu_prenorm_graph_replays_equal_rms_norm_then_router_route(routing, e, h, gen):
    """graph_replays_equal of the prenorm variant: each (weights, ids, normed,
    new_residual) equal to rms_norm then router_route bit for bit, the norm's rstd
    included (same warps, same reduction order)."""
    from kernels.triton_router_route import counters, router_route_prenorm

    dev = torch.device("cuda")
    kw = gpu_routing(routing, e, gen, dev)
    layers, t, eps = 24, 16, 1e-6
    x = torch.randn(layers, t, h, generator=gen).to(dev, torch.bfloat16)
    res = (torch.randn(layers, t, h, generator=gen) * 4).to(dev, torch.bfloat16)
    nw = (1 + 0.3 * torch.randn(layers, h, generator=gen)).to(dev, torch.bfloat16)
    w = (torch.randn(layers, e, h, generator=gen) * 0.02).to(dev)

    def args(i: int, n: int) -> tuple[Any, ...]:
        return x[i, :n], res[i, :n], nw[i], eps, w[i], torch.float32

    def refresh() -> None:
        x.copy_(torch.randn(layers, t, h, generator=gen).to(dev, torch.bfloat16))
        res.copy_((torch.randn(layers, t, h, generator=gen) * 4).to(dev, torch.bfloat16))

    graph_replays_equal(lambda i, n: router_route_prenorm(*args(i, n), **kw),
                        lambda i, n: _norm_then_route(*args(i, n), kw), refresh, layers, t)
    assert not counters(dev, t).any()
