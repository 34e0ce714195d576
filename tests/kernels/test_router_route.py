"""The fused router-logits + routing kernel (kernels/triton_router_route.py) against the two
kernels it replaces, router_logits then moe_route: the same weights and ids bit for bit
(the same jit helpers do the arithmetic), its per-token counters back at zero after every
launch, and, in the engine (engine.models.moe.ROUTER_ROUTE_FUSED), the same decode step
with one kernel fewer per MoE layer. The PRENORM variant: test_router_route_prenorm.py."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()

# (scoring_func, bias, renormalize, routed_scaling_factor, round_dtype, num_shared,
#  n_group, topk_group, E, top_k); no E is a multiple of the logits' 8-expert tile
ROUTINGS: dict[str, tuple[Any, ...]] = {
    # DeepSeek-V2(-Lite): softmax, greedy, shared experts as extra columns
    "v2": ("softmax", False, False, 1.0, None, 2, None, None, 20, 6),
    # DeepSeek-V2: group_limited_greedy, scaled
    "v2_groups": ("softmax", False, False, 16.0, None, 0, 4, 2, 20, 3),
    # DeepSeek-V3: sigmoid + score-correction bias, expert groups, renormalized, scaled,
    # weights rounded to the model's dtype, one shared expert
    "v3": ("sigmoid", True, True, 2.5, torch.bfloat16, 1, 4, 2, 36, 4),
    # Qwen3-MoE: softmax, renormalized (norm_topk_prob), rounded
    "qwen3": ("softmax", False, True, 1.0, torch.bfloat16, 0, None, None, 12, 2),
}
# (x dtype, router dtype, logits dtype, H): DeepSeek's float32 router over a bf16 hidden
# state (H a multiple of the 256-wide K tile), and a router in the model's dtype (not)
DTYPES = {"fp32_router": (torch.bfloat16, torch.float32, torch.float32, 256),
          "model_dtype": (torch.bfloat16, torch.bfloat16, torch.bfloat16, 200)}


def _inputs(routing: str, dtypes: str, t: int, gen: torch.Generator, device: torch.device
            ) -> tuple[torch.Tensor, torch.Tensor, torch.dtype, dict[str, Any]]:
    scoring, bias, renorm, scale, rnd, shared, ng, tg, e, k = ROUTINGS[routing]
    xd, wd, od, h = DTYPES[dtypes]
    x = torch.randn(t, h, generator=gen).to(device=device, dtype=xd)
    w = (torch.randn(e, h, generator=gen) * 0.1).to(device=device, dtype=wd)
    b = torch.randn(e, generator=gen).to(device) * 0.1 if bias else None
    kw = dict(top_k=k, scoring_func=scoring, renormalize=renorm, routed_scaling_factor=scale,
              e_score_correction_bias=b, round_dtype=rnd, num_shared=shared, n_group=ng,
              topk_group=tg)
    return x, w, od, kw


def _unfused(x: torch.Tensor, w: torch.Tensor, out_dtype: torch.dtype,
             kw: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
    from kernels.triton_moe_route import moe_route
    from kernels.triton_router_logits import router_logits

    kw = dict(kw)
    return moe_route(router_logits(x, w, out_dtype), kw.pop("top_k"), kw.pop("scoring_func"),
                     kw.pop("renormalize"), **kw)


@pytest.mark.parametrize("t", [1, 3, 16])
@pytest.mark.parametrize("dtypes", sorted(DTYPES))
@pytest.mark.parametrize("routing", sorted(ROUTINGS))
def test_equals_router_logits_then_moe_route(routing, dtypes, t, gen, device):
    from kernels.triton_router_route import counters, router_route

    x, w, od, kw = _inputs(routing, dtypes, t, gen, device)
    weights, ids = router_route(x, w, od, **kw)
    want_w, want_ids = _unfused(x, w, od, kw)
    assert weights.dtype == torch.float32 and ids.dtype == torch.int64
    assert weights.shape == ids.shape == (t, kw["top_k"] + kw["num_shared"])
    assert torch.equal(ids, want_ids)
    assert torch.equal(weights, want_w)
    # every token's last program reset its counter: the next launch finds zeros
    assert not counters(device, t).any()


def test_counters_reset_so_launches_repeat_and_layers_share_them(gen, device):
    from kernels.triton_router_route import counters, router_route

    x, w, od, kw = _inputs("v3", "fp32_router", 5, gen, device)
    first = router_route(x, w, od, **kw)
    buf = counters(device, 5)
    assert not buf.any()
    # another "layer" (other shapes, the same counters) between two identical launches
    x2, w2, od2, kw2 = _inputs("v2", "model_dtype", 3, gen, device)
    other = router_route(x2, w2, od2, **kw2)
    again = router_route(x, w, od, **kw)
    assert counters(device, 5) is buf and not buf.any()
    assert torch.equal(first[0], again[0]) and torch.equal(first[1], again[1])
    assert all(torch.equal(a, b) for a, b in zip(other, _unfused(x2, w2, od2, kw2),
                                                   strict=True))


def test_counters_grow_and_keep_what_graphs_hold(gen, device):
    import kernels.triton_router_route as rr

    small = rr.counters(device, 1)
    assert small.numel() >= rr.MIN_COUNTERS
    t = small.numel() + 3
    x, w, od, kw = _inputs("qwen3", "fp32_router", t, gen, device)
    got = rr.router_route(x, w, od, **kw)
    big = rr.counters(device, t)
    assert big.numel() >= t and big is not small and not big.any()
    assert any(r is small for r in rr._RETIRED)  # a graph captured with it may replay
    assert all(torch.equal(a, b) for a, b in zip(got, _unfused(x, w, od, kw), strict=True))


def test_counters_cover_the_engine_and_are_never_allocated_in_a_capture(monkeypatch):
    import kernels.triton_router_route as rr
    from engine.models.moe import ROUTER_LOGITS_MAX_TOKENS

    # the first launch allocates for every token count the engine sends here
    assert rr.MIN_COUNTERS >= ROUTER_LOGITS_MAX_TOKENS
    # a capture that finds too few counters raises instead of capturing a memset (an index
    # no machine has: nothing is allocated there before the check)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    with pytest.raises(RuntimeError, match="capture"):
        rr.counters(torch.device("cuda", 97), 4)
    assert torch.device("cuda", 97) not in rr._COUNTERS


def test_no_tokens_and_bad_arguments(device):
    from kernels.triton_router_route import router_route

    w = torch.randn(8, 64, device=device)
    weights, ids = router_route(torch.empty(0, 64, device=device), w, torch.float32, 2,
                                "softmax", True, num_shared=1)
    assert weights.shape == ids.shape == (0, 3)
    x = torch.randn(2, 64, device=device)
    with pytest.raises(ValueError, match="x, w: expected"):
        router_route(torch.randn(2, 32, device=device), w, torch.float32, 2, "softmax", True)
    with pytest.raises(ValueError, match="top_k"):
        router_route(x, w, torch.float32, 9, "softmax", True)
    with pytest.raises(ValueError, match="scoring_func"):
        router_route(x, w, torch.float32, 2, "tanh", True)
    with pytest.raises(ValueError, match="n_group"):
        router_route(x, w, torch.float32, 2, "softmax", True, n_group=3, topk_group=1)
    with pytest.raises(ValueError, match="e_score_correction_bias"):
        router_route(x, w, torch.float32, 2, "sigmoid", True,
                     e_score_correction_bias=torch.zeros(7, device=device))


def _switches(monkeypatch, fused: bool, prenorm: bool = False) -> None:
    import engine.models.moe as moe

    monkeypatch.setattr(moe, "ROUTER_ROUTE_FUSED", fused)
    monkeypatch.setattr(moe, "ROUTER_PRENORM", prenorm)


def _recording(model: Any, logits: list[torch.Tensor]) -> Any:
    """model, its logits appended to `logits` as it computes them."""
    head = model.compute_logits

    def compute_logits(hidden: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = head(hidden)
        logits.append(out.clone())
        return out

    model.compute_logits = compute_logits
    return model


def _decode_step(tmp_path, version: str, batch: int, fused: bool, monkeypatch,
                 prenorm: bool = False, **config: Any) -> tuple[dict[str, Any], torch.Tensor]:
    """bench/decode_op_count's decode step (the CUDA kernel set, interpreted) with the
    switches set: its kernels per layer and its logits. config: overrides of the model's
    config (decode_op_count.write_config's)."""
    import bench.decode_op_count as doc
    import engine.weights as weights

    _switches(monkeypatch, fused, prenorm)
    logits: list[torch.Tensor] = []
    build = weights.build_model
    monkeypatch.setattr(weights, "build_model",
                        lambda *a, **kw: _recording(build(*a, **kw), logits))
    torch.manual_seed(0)  # the step's token ids and KV cache (the weights are seeded)
    counts = doc.count_decode_step(doc.write_config(str(tmp_path / f"{version}.json"),
                                                    version, **config), batch=batch)
    assert len(logits) == 1
    return counts, logits[0]


@pytest.mark.skipif(HAS_CUDA, reason="counts the interpreter's launches")
@pytest.mark.parametrize("version,batch", [("v2", 1), ("v3", 3)])
def test_engine_switch_gives_the_same_step_with_one_kernel_fewer(version, batch, tmp_path,
                                                                 monkeypatch):
    from kernels.triton_router_route import MIN_COUNTERS, counters

    counters(torch.device("cpu"), MIN_COUNTERS)  # allocated before counting: not a step's
    off, off_logits = _decode_step(tmp_path, version, batch, False, monkeypatch)
    on, on_logits = _decode_step(tmp_path, version, batch, True, monkeypatch)
    assert torch.equal(on_logits, off_logits)
    assert torch.equal(on_logits.argmax(-1), off_logits.argmax(-1))
    assert on["layer.0"].total == off["layer.0"].total  # the dense layer: no router
    for layer in ("layer.1", "layer.2"):
        a, b = off[layer], on[layer]
        assert b.total == a.total - 1, (layer, a, b)
        assert a.triton["_router_logits_kernel"] == a.triton["_route_kernel"] == 1
        assert b.triton["_router_route_kernel"] == 1
        assert "_router_logits_kernel" not in b.triton and "_route_kernel" not in b.triton
        assert b.aten == a.aten


# The GPU tests' routings (V2-Lite's and V3's) and graph check, shared with
# test_router_route_prenorm.py
def gpu_routing(routing: str, e: int, gen: torch.Generator, dev: torch.device
                ) -> dict[str, Any]:
    if routing == "v2_lite":
        return dict(top_k=6, scoring_func="softmax", renormalize=False, num_shared=2)
    return dict(top_k=8, scoring_func="sigmoid", renormalize=True, routed_scaling_factor=2.5,
                e_score_correction_bias=torch.randn(e, generator=gen).to(dev) * 0.1,
                round_dtype=torch.bfloat16, num_shared=1, n_group=8, topk_group=4)


def graph_replays_equal(launch: Callable[[int, int], tuple[torch.Tensor, ...]],
                        unfused: Callable[[int, int], tuple[torch.Tensor, ...]],
                        refresh: Callable[[], None], layers: int, t: int) -> None:
    """The race itself, on hardware: `layers` launches (layer i, n tokens) back to back in
    a captured graph per token count (t and 1), every "layer" sharing the counters,
    replayed 50 times after refresh() drew fresh inputs; each output equal to the unfused
    kernels' bit for bit."""
    for n in (1, t):  # compile both token counts' specializations outside the capture
        launch(0, n)
        unfused(0, n)
    outs: dict[int, list[tuple[torch.Tensor, ...]]] = {}
    graphs = {}
    for n in (t, 1):
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            outs[n] = [launch(i, n) for i in range(layers)]
        graphs[n] = g
    for step in range(50):
        refresh()
        for n in (t, 1):
            graphs[n].replay()
            for i in range(layers):
                for j, (a, b) in enumerate(zip(outs[n][i], unfused(i, n), strict=True)):
                    assert torch.equal(a, b), (step, n, i, j)
    torch.cuda.synchronize()


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("routing,e,h", [("v2_lite", 64, 2048), ("v3", 256, 7168)])
def test_gpu_graph_replays_equal_the_unfused_kernels(routing, e, h, gen):
    """graph_replays_equal of the fused kernel against router_logits + moe_route, with PDL
    where the GPU has it."""
    from kernels.triton_router_route import counters, router_route

    dev = torch.device("cuda")
    kw = gpu_routing(routing, e, gen, dev)
    layers, t = 24, 16
    x = torch.randn(layers, t, h, generator=gen).to(dev, torch.bfloat16)
    w = (torch.randn(layers, e, h, generator=gen) * 0.02).to(dev)

    def refresh() -> None:
        x.copy_(torch.randn(layers, t, h, generator=gen).to(dev, torch.bfloat16))

    graph_replays_equal(lambda i, n: router_route(x[i, :n], w[i], torch.float32, **kw),
                        lambda i, n: _unfused(x[i, :n], w[i], torch.float32, kw),
                        refresh, layers, t)
    assert not counters(dev, t).any()
