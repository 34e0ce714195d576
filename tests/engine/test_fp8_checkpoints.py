"""FP8 checkpoints (block-wise, per-channel, per-tensor static, weight-only) quantized by the
test, run on CPU: logits close to the same model's dequantized weights in float32, refusal
of schemes the engine does not implement, and --quantization fp8 at load."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from fp8_models import FORMATS, engine_logits, quant_config, teacher_forced_agreement, write_fp8
from tiny_models import PROMPTS, make_tiny_model

from engine.sampling_params import SamplingParams

# 128-wide projections so 128 x 128 weight blocks are whole along K. A narrower init than
# tiny_models' default: at 0.3 a random 2-layer model amplifies FP8 activation rounding
# (2.6% per projection) to 22-49% of the logits' norm; at 0.05, 5-6%.
BLOCKY = dict(hidden_size=128, intermediate_size=256, num_attention_heads=4,
              num_key_value_heads=2, initializer_range=0.05)
PROMPT = list(range(3, 40))  # 36 prefill rows: above the weight-only row limit


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


@pytest.fixture(scope="module")
def src(tmp_path_factory):
    root = tmp_path_factory.mktemp("fp8src")
    return {a: make_tiny_model(str(root / a), a, seed=3, **BLOCKY) for a in ("llama", "qwen2")}


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_fp8_logits_close_to_dequantized_weights(src, tmp_path, fmt, arch):
    fp8, deq = write_fp8(src[arch], str(tmp_path / "fp8"), str(tmp_path / "deq"), fmt)
    # up to 16 rows a step (a short prompt, then decode): weight-only, the same weights in
    # float32 either way
    short = PROMPT[:12]
    for got, ref in zip(engine_logits(fp8, short), engine_logits(deq, short), strict=True):
        assert _rel(got, ref) < 1e-5, (fmt, _rel(got, ref))
    # a 36-row prefill: activations quantized to FP8 (weight-only schemes keep them)
    pre, _ = engine_logits(fp8, PROMPT)
    ref_pre, _ = engine_logits(deq, PROMPT)
    err = _rel(pre, ref_pre)
    if fmt == "ct_weight_only":
        assert err < 1e-5, err
    else:
        assert 1e-6 < err < 0.1, err  # activation rounding shows, and stays small
        agree = (pre.argmax(-1) == ref_pre.argmax(-1)).float().mean().item()
        assert agree >= 0.75, agree


def test_fp8_weights_are_stored_as_fp8(src, tmp_path):
    from engine.attention import kernels_for
    from engine.quant.fp8_linear import Fp8Linear
    from engine.weights import build_model, read_model_config

    fp8, _ = write_fp8(src["llama"], str(tmp_path / "fp8"), str(tmp_path / "deq"), "fp8_block")
    cfg = read_model_config(fp8)
    cpu = torch.device("cpu")
    model = build_model(fp8, cfg, kernels_for(cpu), cpu, "float32", "auto", 64)
    qkv = model.layers[0].self_attn.qkv_proj
    down = model.layers[1].mlp.down_proj
    assert isinstance(qkv, Fp8Linear) and isinstance(down, Fp8Linear)
    assert qkv.weight.dtype == torch.float8_e4m3fn
    assert tuple(down.weight_scale.shape) == (128, 2)  # K=256 in two 128-column blocks
    assert model.lm_head.weight.dtype == torch.float32


def test_engine_generates_from_an_fp8_checkpoint(src, tmp_path, make_llm):
    fp8, deq = write_fp8(src["llama"], str(tmp_path / "fp8"), str(tmp_path / "deq"),
                         "ct_channel")
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    got = make_llm(fp8, block_size=4).generate(PROMPTS, params)
    ref = make_llm(deq, block_size=4).generate(PROMPTS, params)
    same = sum(a == b for g, r in zip(got, ref, strict=True)
               for a, b in zip(g.token_ids, r.token_ids, strict=True))
    assert same >= 0.9 * 12 * len(PROMPTS), same


def test_quantization_flag_quantizes_a_float_checkpoint(src, make_llm):
    from engine.quant.fp8_linear import Fp8Linear

    pre, dec = engine_logits(src["llama"], PROMPT, quantization="fp8")
    ref_pre, ref_dec = engine_logits(src["llama"], PROMPT)
    assert 1e-6 < _rel(dec, ref_dec) < 0.1 and 1e-6 < _rel(pre, ref_pre) < 0.15
    llm = make_llm(src["llama"], block_size=4, quantization="fp8")
    assert isinstance(llm.engine.runner.model.layers[0].mlp.gate_up_proj, Fp8Linear)
    plain = make_llm(src["llama"], block_size=4)
    assert llm.engine.layout.model != plain.engine.layout.model  # other weights, other KV


def _with_quant(src_dir: str, dst, qc: dict) -> str:
    shutil.copytree(src_dir, dst)
    cfg = json.loads((dst / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps({**cfg, "quantization_config": qc}))
    return str(dst)


def _ct(**group_changes: object) -> dict:
    qc = quant_config("ct_channel")
    qc["config_groups"]["group_0"].update(group_changes)
    return qc


@pytest.mark.parametrize("qc,field", [
    ({"quant_method": "gptq", "bits": 4}, "quant_method"),
    ({"quant_method": "fp8", "fmt": "e5m2"}, "fmt"),
    ({"quant_method": "fp8", "weight_block_size": [128, 100]}, "weight_block_size"),
    ({"quant_method": "fp8", "activation_scheme": "static", "weight_block_size": [128, 128]},
     "activation_scheme"),
    (_ct(weights={"num_bits": 4, "type": "int", "strategy": "group", "group_size": 128}),
     "num_bits"),
    (_ct(weights={"num_bits": 8, "type": "float", "strategy": "group", "group_size": 128}),
     "group_size"),
    (_ct(weights={"num_bits": 8, "type": "float", "strategy": "block",
                  "block_structure": [128, 128]}), "weights.strategy"),
    (_ct(weights={"num_bits": 8, "type": "int", "strategy": "channel"}), "weights.type"),
    (_ct(input_activations={"num_bits": 8, "type": "float", "strategy": "token",
                            "dynamic": False}), "input_activations"),
    (_ct(output_activations={"num_bits": 8, "type": "float"}), "output_activations"),
    ({**quant_config("ct_channel"), "format": "pack-quantized"}, "format"),
    ({**quant_config("ct_channel"), "kv_cache_scheme": {"num_bits": 8}}, "kv_cache_scheme"),
])
def test_unsupported_schemes_are_refused_naming_the_field(src, tmp_path, qc, field):
    from engine.weights import read_model_config

    path = _with_quant(src["llama"], tmp_path / "m", qc)
    with pytest.raises(ValueError, match=f"quantization_config.*{field}"):
        read_model_config(path)


def test_float_weight_where_fp8_is_declared_is_refused(src, tmp_path):
    from engine.attention import kernels_for
    from engine.weights import build_model, read_model_config

    path = _with_quant(src["llama"], tmp_path / "m", quant_config("ct_channel"))
    cfg = read_model_config(path)
    with pytest.raises(ValueError, match="is torch.float32, where the checkpoint"):
        build_model(path, cfg, kernels_for(torch.device("cpu")), torch.device("cpu"),
                    "float32", "auto", 64)


def test_ignored_modules_stay_float(src, tmp_path):
    from engine.attention import kernels_for
    from engine.quant.fp8_linear import Fp8Linear
    from engine.weights import build_model, read_model_config

    fp8, _ = write_fp8(src["llama"], str(tmp_path / "fp8"), str(tmp_path / "deq"), "ct_channel")
    # layer 1's MLP kept in float: put its float weights back and name it in `ignore`
    from safetensors.torch import load_file, save_file

    t = load_file(os.path.join(fp8, "model.safetensors"))
    orig = load_file(os.path.join(src["llama"], "model.safetensors"))
    for p in ("gate_proj", "up_proj", "down_proj"):
        n = f"model.layers.1.mlp.{p}"
        t[f"{n}.weight"] = orig[f"{n}.weight"]
        del t[f"{n}.weight_scale"]
    save_file(t, os.path.join(fp8, "model.safetensors"))
    cfg = json.loads(open(os.path.join(fp8, "config.json")).read())
    cfg["quantization_config"]["ignore"] = ["lm_head", "re:.*layers\\.1\\.mlp\\..*"]
    with open(os.path.join(fp8, "config.json"), "w") as f:
        json.dump(cfg, f)
    model = build_model(fp8, read_model_config(fp8), kernels_for(torch.device("cpu")),
                        torch.device("cpu"), "float32", "auto", 64)
    assert isinstance(model.layers[0].mlp.down_proj, Fp8Linear)
    assert not isinstance(model.layers[1].mlp.down_proj, Fp8Linear)
    assert isinstance(model.layers[1].self_attn.qkv_proj, Fp8Linear)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("fmt", ["fp8_block", "ct_channel", "ct_tensor_static"])
def test_fp8_checkpoint_on_gpu_with_cuda_graphs(src, tmp_path, make_llm, fmt):
    """bf16 on CUDA with decode graphs (weight-only kernels at decode, FP8 x FP8 prefill):
    graphs equal eager, and given the same prefixes the FP8 model picks the dequantized
    weights' tokens more often than the unquantized model does (teacher_forced_agreement
    says why free-running tokens cannot judge this)."""
    fp8, deq = write_fp8(src["llama"], str(tmp_path / "fp8"), str(tmp_path / "deq"), fmt)
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    kw: dict = dict(device="cuda", dtype="bfloat16", block_size=4, max_num_seqs=8)
    llm = make_llm(fp8, **kw)
    graphs = llm.generate(PROMPTS, params)
    eager = make_llm(fp8, enforce_eager=True, **kw).generate(PROMPTS, params)
    assert [g.token_ids for g in graphs] == [e.token_ids for e in eager]
    ref = [r.token_ids for r in make_llm(deq, **kw).generate(PROMPTS, params)]
    fp8_agree = teacher_forced_agreement(llm, PROMPTS, ref)
    float_agree = teacher_forced_agreement(make_llm(src["llama"], **kw), PROMPTS, ref)
    assert fp8_agree >= max(float_agree, 16 * len(PROMPTS) // 2), (fp8_agree, float_agree)


@pytest.mark.parametrize("fmt", ["fp8_block", "ct_tensor_static"])
def test_dummy_weights_of_an_fp8_config(src, tmp_path, make_llm, fmt):
    from engine.quant.fp8_linear import Fp8Linear

    fp8, _ = write_fp8(src["llama"], str(tmp_path / "fp8"), str(tmp_path / "deq"), fmt)
    llm = make_llm(fp8, load_format="dummy", block_size=4)
    down = llm.engine.runner.model.layers[0].mlp.down_proj
    assert isinstance(down, Fp8Linear) and down.groups == (2 if fmt == "fp8_block" else 1)
    assert down.input_scale is None  # random weights: dynamic activation scales
    out = llm.generate(PROMPTS, SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    assert all(len(o.token_ids) == 4 and all(0 <= t < 256 for t in o.token_ids) for o in out)


def test_quantization_flag_parses_and_refuses_other_values():
    import argparse

    from deploy.engine_args import add_engine_args, engine_config
    from engine.config import EngineConfig

    p = argparse.ArgumentParser()
    add_engine_args(p)
    assert engine_config(p.parse_args(["--quantization", "fp8"])).quantization == "fp8"
    assert engine_config(p.parse_args([])).quantization is None
    with pytest.raises(SystemExit):
        p.parse_args(["--quantization", "int4"])
    with pytest.raises(ValueError, match="quantization"):
        EngineConfig(quantization="int4")
