"""FP8 routed experts on CPU (float32): MoE models quantized at load (``--quantization fp8``:
Qwen3-MoE, and DeepSeek-V3 with MLA attention kept float) and FP8 checkpoints with expert
scales (block-wise, per-channel, per-tensor; Qwen3-MoE, and DeepSeek-V3 whose other FP8
tensors load dequantized) written by the tests, against float models of the same
dequantized weights; malformed expert scales refused by name; TP2 equal to TP1.

Every step here runs at most 16 rows (a 16-token budget), so the dense projections run
weight-only too and the FP8 model computes exactly what the dequantized float model does,
up to float32 summation order."""

from __future__ import annotations

import json
import os
import re

import pytest
import torch
from fp8_models import (
    MLA_PROJ,
    PROJ,
    engine_logits,
    teacher_forced_agreement,
    write_fp8,
    write_rows_dequantized,
)
from tiny_deepseek import MODELS as DS_MODELS
from tiny_deepseek import make_tiny_deepseek
from tiny_models import PROMPTS, make_tiny_model

from engine.llm import LLM
from engine.sampling_params import SamplingParams
from kernels.ref_fp8 import FP8

STEPS = 16
GREEDY = SamplingParams(max_tokens=STEPS, temperature=0, ignore_eos=True, logprobs=3)
SHORT = PROMPTS[0]  # 11 tokens: a weight-only prefill
# 256-wide experts: 128 x 128 blocks give two scale groups along K in both GEMMs
WIDE = dict(hidden_size=256, moe_intermediate_size=256)
# what DeepSeek quantizes at load: the dense MLPs and routed experts (not MLA, not the
# shared experts, not the router)
_DS_QUANTIZED = re.compile(r"\.mlp\.(experts\.\d+\.)?(gate|up|down)_proj\.weight$")


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def _run(path: str, **kw: object) -> list:  # type: ignore[type-arg]
    with LLM(path, block_size=4, max_num_batched_tokens=16, **kw) as llm:
        experts = llm.engine.runner.model.layers[1].mlp.experts
        dtype = experts.w13.dtype
        out = llm.generate(PROMPTS, GREEDY)
    return [dtype, out]


def _same_run(got: list, ref: list) -> None:  # type: ignore[type-arg]
    """Greedy tokens equal, and the logprobs of each step's top tokens close."""
    for g, r in zip(got[1], ref[1], strict=True):
        assert g.token_ids == r.token_ids
        for gr, rr in zip(g.logprobs, r.logprobs, strict=True):
            assert gr.logprob == pytest.approx(rr.logprob, abs=1e-4)
            for (ta, la), (tb, lb) in zip(gr.top, rr.top, strict=True):
                assert ta == tb and la == pytest.approx(lb, abs=1e-4)


def _max_logprob_gap(a: list, b: list) -> float:  # type: ignore[type-arg]
    return max(abs(x.logprob - y.logprob) for ga, gb in zip(a[1], b[1], strict=True)
               for x, y in zip(ga.logprobs, gb.logprobs, strict=True)
               if x.token_id == y.token_id)


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):  # type: ignore[no-untyped-def]
    root = tmp_path_factory.mktemp("fp8moe")
    return make_tiny_model(str(root / "qwen3_moe"), "qwen3_moe", seed=7)


def test_qwen3_moe_quantized_at_load_equals_dequantized_weights(qwen, tmp_path):
    deq = write_rows_dequantized(qwen, str(tmp_path / "deq"),
                                 lambda n: n.endswith(".weight") and n.split(".")[-2] in PROJ)
    got, ref = engine_logits(qwen, SHORT, quantization="fp8"), engine_logits(deq, SHORT)
    for g, r in zip(got, ref, strict=True):
        assert _rel(g, r) < 1e-5, _rel(g, r)
    float_pre, _ = engine_logits(qwen, SHORT)
    assert _rel(got[0], float_pre) > 1e-4  # the FP8 rounding is there to see
    fp8_run, deq_run = _run(qwen, quantization="fp8"), _run(deq)
    assert fp8_run[0] == FP8 and deq_run[0] == torch.float32
    _same_run(fp8_run, deq_run)


def test_deepseek_v3_quantized_at_load_equals_dequantized_weights(tmp_path):
    version, kw = DS_MODELS["v3"]
    src = make_tiny_deepseek(str(tmp_path / "ds"), version, seed=4, **kw)
    deq = write_rows_dequantized(src, str(tmp_path / "deq"), _DS_QUANTIZED.search)
    fp8_run, deq_run = _run(src, quantization="fp8"), _run(deq)
    assert fp8_run[0] == FP8
    _same_run(fp8_run, deq_run)
    assert _max_logprob_gap(fp8_run, _run(src)) > 1e-5  # not the float model's


@pytest.mark.parametrize("fmt", ["fp8_block", "ct_channel", "ct_tensor_static"])
def test_fp8_checkpoint_with_expert_scales(tmp_path, fmt):
    from engine.attention import kernels_for
    from engine.weights import build_model, read_model_config

    src = make_tiny_model(str(tmp_path / "src"), "qwen3_moe", seed=8, **WIDE)
    fp8, deq = write_fp8(src, str(tmp_path / "fp8"), str(tmp_path / "deq"), fmt)
    cfg = read_model_config(fp8)
    cpu = torch.device("cpu")
    model = build_model(fp8, cfg, kernels_for(cpu), cpu, "float32", "auto", 64)
    experts = model.layers[1].mlp.experts
    assert experts.w13.dtype == experts.w2.dtype == FP8
    groups = 2 if fmt == "fp8_block" else 1  # K = 256 in 128-column blocks
    assert tuple(experts.w13_scale.shape) == (8, 512, groups)
    assert tuple(experts.w2_scale.shape) == (8, 256, groups)
    for g, r in zip(engine_logits(fp8, SHORT), engine_logits(deq, SHORT), strict=True):
        assert _rel(g, r) < 1e-5, (fmt, _rel(g, r))
    _same_run(_run(fp8), _run(deq))


def test_dummy_weights_of_an_fp8_moe_config(tmp_path, make_llm):
    from fp8_models import quant_config

    src = make_tiny_model(str(tmp_path / "src"), "qwen3_moe", seed=8, **WIDE)
    with open(os.path.join(src, "config.json")) as f:
        cfg = json.load(f)
    (tmp_path / "cfg").mkdir()
    with open(tmp_path / "cfg" / "config.json", "w") as f:
        json.dump({**cfg, "quantization_config": quant_config("fp8_block")}, f)
    llm = make_llm(str(tmp_path / "cfg"), load_format="dummy", block_size=4)
    experts = llm.engine.runner.model.layers[1].mlp.experts
    assert experts.w13.dtype == FP8 and tuple(experts.w13_scale.shape) == (8, 512, 2)
    out = llm.generate(PROMPTS, SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    assert all(len(o.token_ids) == 4 and all(0 <= t < 256 for t in o.token_ids) for o in out)


def test_ignored_experts_stay_float(tmp_path):
    from safetensors.torch import load_file

    from engine.attention import kernels_for
    from engine.weights import build_model, read_model_config

    src = make_tiny_model(str(tmp_path / "src"), "qwen3_moe", seed=8)
    fp8, _ = write_fp8(src, str(tmp_path / "fp8"), str(tmp_path / "deq"), "ct_channel")
    orig = load_file(os.path.join(src, "model.safetensors"))

    def restore(t: dict) -> None:  # layer 2's experts back to float, their scales gone
        for name in [n for n in t if ".layers.2.mlp.experts." in n]:
            del t[name]
        t.update({n: w for n, w in orig.items() if ".layers.2.mlp.experts." in n})
    _edit(fp8, restore)
    with open(os.path.join(fp8, "config.json")) as f:
        cfg = json.load(f)
    cfg["quantization_config"]["ignore"] = ["lm_head", "re:.*layers\\.2\\.mlp\\.experts.*"]
    with open(os.path.join(fp8, "config.json"), "w") as f:
        json.dump(cfg, f)
    cpu = torch.device("cpu")
    model = build_model(fp8, read_model_config(fp8), kernels_for(cpu), cpu, "float32",
                        "auto", 64)
    assert model.layers[1].mlp.experts.w13.dtype == FP8
    assert model.layers[2].mlp.experts.w13.dtype == torch.float32
    assert model.layers[2].mlp.experts.w13_scale is None


def _edit(path: str, change) -> None:  # type: ignore[no-untyped-def]
    from safetensors.torch import load_file, save_file

    f = os.path.join(path, "model.safetensors")
    t = load_file(f)
    change(t)
    save_file(t, f)


E3 = "model.layers.1.mlp.experts.3"


@pytest.mark.parametrize("change,match", [
    (lambda t: t.__setitem__(f"{E3}.gate_proj.weight_scale_inv", torch.ones(3, 3)),
     rf"{E3}.gate_proj.weight_scale_inv: weight_scale_inv: expected \[2, 2\], got \(3, 3\)"),
    (lambda t: t.pop(f"{E3}.down_proj.weight_scale_inv"),
     r"lacks weights .*layers.1.mlp.experts.w2_scale"),
    (lambda t: t.__setitem__(f"{E3}.up_proj.weight", t[f"{E3}.up_proj.weight"].float()),
     "expert 3 up weight is torch.float32, where the checkpoint's quantization_config"),
])
def test_malformed_expert_scales_are_refused_by_name(tmp_path, change, match):
    src = make_tiny_model(str(tmp_path / "src"), "qwen3_moe", seed=8, **WIDE)
    fp8, _ = write_fp8(src, str(tmp_path / "fp8"), str(tmp_path / "deq"), "fp8_block")
    _edit(fp8, change)
    with pytest.raises(ValueError, match=match):
        LLM(fp8, block_size=4)


def test_expert_scale_without_quantization_config_is_refused(tmp_path):
    src = make_tiny_model(str(tmp_path / "src"), "qwen3_moe", seed=8)
    _edit(src, lambda t: t.__setitem__(f"{E3}.gate_proj.weight_scale", torch.ones(48, 1)))
    with pytest.raises(ValueError, match="unexpected weight .*gate_proj.weight_scale"):
        LLM(src, block_size=4)


@pytest.mark.parametrize("fmt", ["fp8_block", "ct_channel"])
def test_fp8_deepseek_checkpoint(tmp_path, fmt):
    """DeepSeek-V3 with every projection FP8 (MLA's, the dense and shared MLPs', the
    routed experts'): the routed experts load FP8, the rest dequantized; the dequantized
    float model's tokens, and TP2's equal TP1's (tensors read whole, cut dequantized)."""
    version, kw = DS_MODELS["v3"]
    src = make_tiny_deepseek(str(tmp_path / "ds"), version, seed=4, **kw)
    fp8, deq = write_fp8(src, str(tmp_path / "fp8"), str(tmp_path / "deq"), fmt,
                         proj=PROJ + MLA_PROJ)
    got = _run(fp8)
    assert got[0] == FP8
    _same_run(got, _run(deq))
    with LLM(fp8, block_size=4, max_num_batched_tokens=16, tensor_parallel_size=2) as llm:
        tp2 = [c.token_ids for c in llm.generate(PROMPTS, GREEDY)]
    assert tp2 == [c.token_ids for c in got[1]]


@pytest.mark.parametrize("change,match", [
    (lambda t: t.pop("model.layers.0.self_attn.kv_b_proj.weight_scale_inv"),
     "layers.0.self_attn.kv_b_proj.weight is float8 and the checkpoint has no "
     "weight_scale_inv"),
    (lambda t: t.__setitem__("model.layers.0.self_attn.o_proj.weight",
                             t["model.layers.0.self_attn.o_proj.weight"].float()),
     "layers.0.self_attn.o_proj.weight_scale_inv scales a weight the checkpoint does not "
     "hold in float8"),
    (lambda t: t.__setitem__("model.layers.1.mlp.shared_experts.down_proj.weight_scale_inv",
                             torch.ones(2, 2)),
     r"shared_experts.down_proj: weight_scale_inv: expected \[1, 1\], got \(2, 2\)"),
])
def test_malformed_fp8_deepseek_checkpoint_is_refused_by_name(tmp_path, change, match):
    version, kw = DS_MODELS["v3"]
    src = make_tiny_deepseek(str(tmp_path / "ds"), version, seed=4, **kw)
    fp8, _ = write_fp8(src, str(tmp_path / "fp8"), str(tmp_path / "deq"), "fp8_block",
                       proj=PROJ + MLA_PROJ)
    _edit(fp8, change)
    with pytest.raises(ValueError, match=match):
        LLM(fp8, block_size=4)


# fp8_block: 128-wide heads and a 512-wide dense MLP, so a TP2 rank's dense rows and
# columns are whole 128 x 128 blocks; the experts are whole per rank at any width
HEAD128 = dict(hidden_size=256, intermediate_size=512, num_attention_heads=2,
               num_key_value_heads=2, head_dim=128, moe_intermediate_size=256)


@pytest.mark.parametrize("fmt,overrides", [("ct_channel", {}), ("fp8_block", HEAD128)])
def test_fp8_expert_checkpoint_tp2_equals_tp1(tmp_path, fmt, overrides):
    """Experts are sharded whole: each rank loads its experts' FP8 weights and scales."""
    src = make_tiny_model(str(tmp_path / "src"), "qwen3_moe", seed=9, **overrides)
    path, _ = write_fp8(src, str(tmp_path / "fp8"), str(tmp_path / "deq"), fmt)
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    outs = []
    for tp in (1, 2):
        with LLM(path, block_size=4, max_num_batched_tokens=16,
                 tensor_parallel_size=tp) as llm:
            experts = llm.engine.runner.model.layers[1].mlp.experts
            assert experts.w13.dtype == FP8 and experts.w13_scale.shape[0] == 8 // tp
            outs.append([c.token_ids for c in llm.generate(PROMPTS, params)])
    assert outs[0] == outs[1]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("fmt", ["fp8_block", "ct_channel", "at_load"])
def test_fp8_experts_on_gpu_with_cuda_graphs(tmp_path, make_llm, fmt):
    """bf16 on CUDA with decode graphs (the Triton fused MoE kernel reading FP8 experts):
    graphs equal eager, and given the same prefixes the FP8 model picks the dequantized
    weights' tokens more often than the unquantized model does (teacher_forced_agreement
    says why free-running tokens cannot judge this)."""
    src = make_tiny_model(str(tmp_path / "src"), "qwen3_moe", seed=8, **WIDE)
    if fmt == "at_load":
        path, kw = src, {"quantization": "fp8"}
        deq = write_rows_dequantized(
            src, str(tmp_path / "deq"),
            lambda n: n.endswith(".weight") and n.split(".")[-2] in PROJ)
    else:
        (path, deq), kw = write_fp8(src, str(tmp_path / "fp8"), str(tmp_path / "deq"), fmt), {}
    params = SamplingParams(max_tokens=STEPS, temperature=0, ignore_eos=True)
    common: dict = dict(device="cuda", dtype="bfloat16", block_size=4, max_num_seqs=8)
    llm = make_llm(path, **common, **kw)
    assert llm.engine.runner.model.layers[1].mlp.experts.w13.dtype == FP8
    graphs = llm.generate(PROMPTS, params)
    eager = make_llm(path, enforce_eager=True, **common, **kw).generate(PROMPTS, params)
    assert [g.token_ids for g in graphs] == [e.token_ids for e in eager]
    ref = [r.token_ids for r in make_llm(deq, **common).generate(PROMPTS, params)]
    fp8_agree = teacher_forced_agreement(llm, PROMPTS, ref)
    float_agree = teacher_forced_agreement(make_llm(src, **common), PROMPTS, ref)
    assert fp8_agree >= max(float_agree, STEPS * len(PROMPTS) // 2), (fp8_agree, float_agree)


def test_fp8_experts_expert_parallel_under_dp_attention(tmp_path):
    """DeepSeek-V3 quantized at load with data-parallel attention (two groups of one rank,
    experts split over both ranks): each rank quantizes its own experts, and the greedy
    tokens are the single rank's."""
    version, kw = DS_MODELS["v3"]
    src = make_tiny_deepseek(str(tmp_path / "ds"), version, seed=4, **kw)
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    common: dict = dict(block_size=4, max_num_batched_tokens=16, quantization="fp8")
    with LLM(src, **common) as llm:
        want = [c.token_ids for c in llm.generate(PROMPTS, params)]
    with LLM(src, tensor_parallel_size=2, data_parallel_size=2, **common) as llm:
        experts = llm.engine.runner.model.layers[1].mlp.experts
        assert experts.w13.dtype == FP8 and experts.w13_scale.shape[0] == 4  # 8 over 2
        assert [c.token_ids for c in llm.generate(PROMPTS, params)] == want
