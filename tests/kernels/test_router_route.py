"""The fused router-logits + routing kernel (kernels/triton_router_route.py) against the two
kernels it replaces, router_logits then moe_route: the same weights and ids bit for bit
(the same jit helpers do the arithmetic), its per-token counters back at zero after every
launch, and, in the engine (engine.models.moe.ROUTER_ROUTE_FUSED), the same decode step
with one kernel fewer per MoE layer. Its PRENORM variant (router_route_prenorm, the
residual add + RMSNorm in the same launch) against kernels/triton_norm.rms_norm then
router_route, and in the engine (engine.models.moe.ROUTER_PRENORM) one kernel fewer
again."""

from __future__ import annotations

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
                 prenorm: bool = False) -> tuple[dict[str, Any], torch.Tensor]:
    """bench/decode_op_count's decode step (the CUDA kernel set, interpreted) with the
    switches set: its kernels per layer and its logits."""
    import bench.decode_op_count as doc
    import engine.weights as weights

    _switches(monkeypatch, fused, prenorm)
    logits: list[torch.Tensor] = []
    build = weights.build_model
    monkeypatch.setattr(weights, "build_model",
                        lambda *a, **kw: _recording(build(*a, **kw), logits))
    torch.manual_seed(0)  # the step's token ids and KV cache (the weights are seeded)
    counts = doc.count_decode_step(doc.write_config(str(tmp_path / f"{version}.json"),
                                                    version), batch=batch)
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


def _qwen3_moe_step(path: str, batch: int, fused: bool, prenorm: bool, monkeypatch
                    ) -> tuple[dict[str, Any], torch.Tensor]:
    """A Qwen3-MoE decode step as _decode_step's (GQA attention, its K-split o_proj off
    CUDA): its kernels per layer and its logits."""
    import bench.decode_op_count as doc
    from engine.attention import AttentionMetadata, kernels_for
    from engine.weights import build_model, read_model_config

    _switches(monkeypatch, fused, prenorm)
    cfg = read_model_config(path)
    logits: list[torch.Tensor] = []
    model = _recording(build_model(path, cfg, kernels_for(torch.device("cuda")),
                                   torch.device("cpu"), "float32", "dummy", 64), logits)
    torch.manual_seed(0)
    context, bs = 9, 4
    per_req = -(-context // bs)
    kv = torch.randn(batch * per_req + 1, cfg.num_layers, 2, bs, cfg.num_kv_heads,
                     cfg.head_dim) * 0.1
    tables = torch.arange(1, batch * per_req + 1, dtype=torch.int32).view(batch, per_req)
    slots = tables[:, (context - 1) // bs].long() * bs + (context - 1) % bs
    meta = AttentionMetadata(
        slot_mapping=slots, block_tables=tables,
        cu_seqlens_q=torch.arange(batch + 1, dtype=torch.int32),
        seq_lens=torch.full((batch,), context, dtype=torch.int32), decode_only=True)
    ids = torch.randint(3, cfg.vocab_size, (batch,))
    counts = doc._count_forward(model, ids, torch.full((batch,), context - 1), kv, meta)
    assert len(logits) == 1
    return counts, logits[0]


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
    from tiny_models import make_tiny_model

    from kernels.triton_router_route import MIN_COUNTERS, counters

    counters(torch.device("cpu"), MIN_COUNTERS)
    path = make_tiny_model(str(tmp_path / "qwen3_moe"), "qwen3_moe")
    _qwen3_moe_step(path, 2, True, False, monkeypatch)  # the first step's one-off buffers
    off, off_logits = _qwen3_moe_step(path, 2, True, False, monkeypatch)
    on, on_logits = _qwen3_moe_step(path, 2, True, True, monkeypatch)
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
def test_gpu_graph_replays_equal_the_unfused_kernels(routing, e, h, gen):
    """The race itself, on hardware: many launches of the fused kernel back to back in a
    captured graph (every "layer" sharing the counters, launched with PDL where the GPU has
    it), replayed with fresh inputs, each equal to router_logits + moe_route."""
    from kernels.triton_router_route import counters, router_route

    dev = torch.device("cuda")
    kw: dict[str, Any] = (
        dict(top_k=6, scoring_func="softmax", renormalize=False, num_shared=2)
        if routing == "v2_lite" else
        dict(top_k=8, scoring_func="sigmoid", renormalize=True, routed_scaling_factor=2.5,
             e_score_correction_bias=torch.randn(e, generator=gen).to(dev) * 0.1,
             round_dtype=torch.bfloat16, num_shared=1, n_group=8, topk_group=4))
    layers, t = 24, 16
    x = torch.randn(layers, t, h, generator=gen).to(dev, torch.bfloat16)
    w = (torch.randn(layers, e, h, generator=gen) * 0.02).to(dev)
    for n in (1, t):  # compile both token counts' specializations outside the capture
        router_route(x[0, :n], w[0], torch.float32, **kw)
        _unfused(x[0, :n], w[0], torch.float32, kw)
    outs: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}
    graphs = {}
    for n in (t, 1):
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            outs[n] = [router_route(x[i, :n], w[i], torch.float32, **kw)
                       for i in range(layers)]
        graphs[n] = g
    for step in range(50):
        x.copy_(torch.randn(layers, t, h, generator=gen).to(dev, torch.bfloat16))
        for n in (t, 1):
            graphs[n].replay()
            for i in range(layers):
                want = _unfused(x[i, :n], w[i], torch.float32, kw)
                got = outs[n][i]
                assert torch.equal(got[1], want[1]), (step, n, i)
                assert torch.equal(got[0], want[0]), (step, n, i)
    torch.cuda.synchronize()
    assert not counters(dev, t).any()


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("routing,e,h", [("v2_lite", 64, 2048), ("v3", 256, 7168)])
def test_gpu_prenorm_graph_replays_equal_rms_norm_then_router_route(routing, e, h, gen):
    """The prenorm variant on hardware, as above: in a captured graph of many launches, each
    (weights, ids, normed, new_residual) equal to rms_norm then router_route bit for bit,
    the norm's rstd included (same warps, same reduction order), at both token counts."""
    from kernels.triton_router_route import counters, router_route_prenorm

    dev = torch.device("cuda")
    kw: dict[str, Any] = (
        dict(top_k=6, scoring_func="softmax", renormalize=False, num_shared=2)
        if routing == "v2_lite" else
        dict(top_k=8, scoring_func="sigmoid", renormalize=True, routed_scaling_factor=2.5,
             e_score_correction_bias=torch.randn(e, generator=gen).to(dev) * 0.1,
             round_dtype=torch.bfloat16, num_shared=1, n_group=8, topk_group=4))
    layers, t, eps = 24, 16, 1e-6
    x = torch.randn(layers, t, h, generator=gen).to(dev, torch.bfloat16)
    res = (torch.randn(layers, t, h, generator=gen) * 4).to(dev, torch.bfloat16)
    nw = (1 + 0.3 * torch.randn(layers, h, generator=gen)).to(dev, torch.bfloat16)
    w = (torch.randn(layers, e, h, generator=gen) * 0.02).to(dev)

    def args(i: int, n: int) -> tuple[Any, ...]:
        return x[i, :n], res[i, :n], nw[i], eps, w[i], torch.float32

    for n in (1, t):  # compile both token counts' specializations outside the capture
        router_route_prenorm(*args(0, n), **kw)
        _norm_then_route(*args(0, n), kw)
    outs: dict[int, list[tuple[torch.Tensor, ...]]] = {}
    graphs = {}
    for n in (t, 1):
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            outs[n] = [router_route_prenorm(*args(i, n), **kw) for i in range(layers)]
        graphs[n] = g
    for step in range(50):
        x.copy_(torch.randn(layers, t, h, generator=gen).to(dev, torch.bfloat16))
        res.copy_((torch.randn(layers, t, h, generator=gen) * 4).to(dev, torch.bfloat16))
        for n in (t, 1):
            graphs[n].replay()
            for i in range(layers):
                want = _norm_then_route(*args(i, n), kw)
                for j, (a, b) in enumerate(zip(outs[n][i], want, strict=True)):
                    assert torch.equal(a, b), (step, n, i, j)
    torch.cuda.synchronize()
    assert not counters(dev, t).any()
