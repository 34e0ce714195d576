"""engine.models.moe.NEXT_NORM_FUSED in the engine: the norm after an MoE layer (the next
layer's input_layernorm, or the model's final norm) inside the experts' down + sum launch
(kernels/triton_moe_down_sum.py's next_norm) at a decode step of one token. Small
DeepSeek-V2, V3 and Qwen3-MoE models (bench/decode_op_count's, the CUDA kernel set in the
interpreter) decode the same logits bit for bit with one kernel fewer per MoE layer that
another follows, alone and with the fused routing and its prenorm on too."""

from __future__ import annotations

import collections
from typing import Any

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
pytestmark = pytest.mark.skipif(HAS_CUDA, reason="counts the interpreter's launches")

# the MoE layers of bench/decode_op_count's models (3 layers; V2/V3: layer 0 dense)
MOE_LAYERS = {"v2": (1, 2), "v3": (1, 2), "qwen3": (0, 1, 2)}
_WARM: set[str] = set()  # the models that ran a step in this process


def _switches(monkeypatch: pytest.MonkeyPatch, next_norm: bool, route: bool,
              extra: bool = False, down_sum: bool = True) -> None:
    import engine.models.mla as mla
    import engine.models.moe as moe
    import kernels.triton_moe as tm

    monkeypatch.setattr(tm, "DOWN_SUM_MAX_TOKENS", 1 if down_sum else 0)
    monkeypatch.setattr(moe, "NEXT_NORM_FUSED", next_norm)
    monkeypatch.setattr(moe, "ROUTER_ROUTE_FUSED", route)
    monkeypatch.setattr(moe, "ROUTER_PRENORM", route)
    monkeypatch.setattr(tm, "GATE_UP_GEMV_MAX_TOKENS", 1 if extra else 0)
    monkeypatch.setattr(mla, "FUSED_LATENT_ABSORB", extra)
    monkeypatch.setattr(mla, "FUSED_UP_MERGE", extra)


def _allocate_counters() -> None:
    """The counters' first allocation is a memset: made before counting, not a step's."""
    from kernels.last_program import MIN_COUNTERS
    from kernels.triton_moe_down_sum import counters
    from kernels.triton_router_route import counters as route_counters

    counters(torch.device("cpu"), MIN_COUNTERS)
    route_counters(torch.device("cpu"), MIN_COUNTERS)


def _step(tmp_path: Any, version: str, monkeypatch: pytest.MonkeyPatch, next_norm: bool,
          route: bool = False, extra: bool = False, hooks: bool = True,
          down_sum: bool = True) -> tuple[Any, torch.Tensor]:
    """bench/decode_op_count's one-token decode step with the switches set: its kernels
    per layer (hooks: the tool's own count; False: the whole step's Triton launches by
    kernel, no hook on any module, so the final norm may fuse) and its logits."""
    import bench.decode_op_count as doc
    from tests.kernels.test_moe_down_sum import _launches

    _switches(monkeypatch, next_norm, route, extra, down_sum)
    _allocate_counters()
    if version not in _WARM:  # a first step's one-off buffers (Qwen3's): not counted
        _WARM.add(version)
        _step(tmp_path, version, monkeypatch, next_norm, route, extra, hooks, down_sum)
    logits: list[torch.Tensor] = []
    count = doc._count_forward

    def forward(model: Any, ids: torch.Tensor, pos: torch.Tensor, kv: torch.Tensor,
                meta: Any) -> Any:
        if hooks:
            counts = count(model, ids, pos, kv, meta)
            logits.append(model.compute_logits(model(ids, pos, kv, meta)))
            return counts
        with torch.inference_mode(), _launches() as launches:
            logits.append(model.compute_logits(model(ids, pos, kv, meta)))
        return collections.Counter(launches)

    monkeypatch.setattr(doc, "_count_forward", forward)
    torch.manual_seed(0)  # the step's token ids and KV cache (the weights are seeded)
    counts = doc.count_decode_step(doc.write_config(str(tmp_path / f"{version}.json"),
                                                    version), batch=1)
    return counts, logits[0]


def _assert_saves_next_norms(off: dict[str, Any], on: dict[str, Any], version: str) -> None:
    """Each layer after an MoE layer: its input_layernorm's launch gone (into the MoE
    layer's down + sum, which the MoE layer still launches once); everything else equal.
    The head's final norm stays: bench/decode_op_count hooks it, and the engine then
    leaves it apart (its count attributes the head by that hook)."""
    moe = MOE_LAYERS[version]
    for i in range(3):
        a, b = off[f"layer.{i}"], on[f"layer.{i}"]
        if i in moe:
            assert a.triton["_down_sum_kernel"] == b.triton["_down_sum_kernel"] == 1
        if i - 1 in moe:
            assert b.total == a.total - 1, (i, a, b)
            assert b.triton["_rms_norm_kernel"] == a.triton["_rms_norm_kernel"] - 1, (i, a, b)
        else:
            assert b.total == a.total, (i, a, b)
        assert b.aten == a.aten
    assert on["head"].total == off["head"].total


@pytest.mark.parametrize("version", ["v2", "v3", "qwen3"])
def test_next_norm_gives_the_same_step_with_the_norm_launches_gone(version, tmp_path,
                                                                   monkeypatch):
    off, off_logits = _step(tmp_path, version, monkeypatch, False)
    on, on_logits = _step(tmp_path, version, monkeypatch, True)
    assert torch.equal(on_logits, off_logits)
    _assert_saves_next_norms(off, on, version)


@pytest.mark.parametrize("version", ["v3", "qwen3"])
def test_next_norm_with_the_fused_routing_and_its_prenorm(version, tmp_path, monkeypatch):
    off, off_logits = _step(tmp_path, version, monkeypatch, False, route=True)
    on, on_logits = _step(tmp_path, version, monkeypatch, True, route=True)
    assert torch.equal(on_logits, off_logits)
    _assert_saves_next_norms(off, on, version)
    # the MoE layer's post-attention norm is in its router's launch: a layer after an MoE
    # layer launches no norm of its own but Qwen3's per-head q/k norms (fused into RoPE)
    # and V3's q_a_layernorm
    last = on["layer.2"].triton
    assert last["_rms_norm_kernel"] == (1 if version == "v3" else 0), last


@pytest.mark.parametrize("version", ["v2", "qwen3"])
def test_next_norm_runs_the_final_norm_where_no_hook_watches_it(version, tmp_path,
                                                                monkeypatch):
    # unhooked, the last MoE layer runs the model's final norm too: one norm launch fewer
    # per MoE layer, the last one included
    off, off_logits = _step(tmp_path, version, monkeypatch, False, hooks=False)
    on, on_logits = _step(tmp_path, version, monkeypatch, True, hooks=False)
    assert torch.equal(on_logits, off_logits)
    saved = len(MOE_LAYERS[version])
    assert on["_rms_norm_kernel"] == off["_rms_norm_kernel"] - saved, (off, on)
    assert sum(on.values()) == sum(off.values()) - saved


def test_next_norm_does_nothing_without_the_down_sum_launch(tmp_path, monkeypatch):
    # DOWN_SUM_MAX_TOKENS off: no launch to hold the norm, the same step and kernels
    off, off_logits = _step(tmp_path, "v2", monkeypatch, False, down_sum=False)
    on, on_logits = _step(tmp_path, "v2", monkeypatch, True, down_sum=False)
    assert torch.equal(on_logits, off_logits)
    assert "_down_sum_kernel" not in on["layer.1"].triton
    for where in off:
        assert on[where].triton == off[where].triton and on[where].aten == off[where].aten


def test_next_norm_is_refused_where_it_does_not_apply(monkeypatch):
    """_next_norm's None (the layer then runs the norm apart): the switch off, the
    torch-reference kernel set, two tokens, a tensor-parallel group after the experts, an
    exchange, shared experts added apart, no norm after the layer."""
    import engine.models.moe as moe
    import kernels.triton_moe as tm
    from engine.attention import kernels_for
    from engine.config import MoEConfig
    from engine.models.llama import RMSNorm

    cfg = MoEConfig(num_experts=4, top_k=2, intermediate_size=16, layers=(0,),
                    renormalize=True)
    triton_set = kernels_for(torch.device("cuda"))
    block = moe.SparseMoeBlock(cfg, 32, triton_set, None)
    norm = RMSNorm(32, 1e-6, triton_set)
    x = torch.randn(1, 32)
    monkeypatch.setattr(tm, "DOWN_SUM_MAX_TOKENS", 1)
    monkeypatch.setattr(moe, "NEXT_NORM_FUSED", True)
    assert block._next_norm(x, x, norm, False) is norm  # it applies
    assert block._next_norm(x, x, None, False) is None
    assert block._next_norm(x, x, norm, True) is None  # the shared experts densely
    assert block._next_norm(torch.randn(2, 32), torch.randn(2, 32), norm, False) is None
    assert block._next_norm(x, x.bfloat16(), norm, False) is None
    ref = moe.SparseMoeBlock(cfg, 32, kernels_for(torch.device("cpu")), None)
    assert ref._next_norm(x, x, norm, False) is None
    for attr, value in (("group", object()), ("exchange", object()),
                        ("shared_experts", object())):
        setattr(block, attr, value)
        assert block._next_norm(x, x, norm, False) is None, attr
        setattr(block, attr, None)
    monkeypatch.setattr(moe, "NEXT_NORM_FUSED", False)
    assert block._next_norm(x, x, norm, False) is None
    monkeypatch.setattr(moe, "NEXT_NORM_FUSED", True)
    monkeypatch.setattr(tm, "DOWN_SUM_MAX_TOKENS", 0)
    assert block._next_norm(x, x, norm, False) is None
