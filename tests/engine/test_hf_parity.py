"""Greedy tokens equal HF transformers' on small random Llama, Qwen2 and Qwen3 models."""

from __future__ import annotations

import pytest
from tiny_models import PROMPTS, hf_greedy

from engine.sampling_params import SamplingParams


@pytest.mark.parametrize("arch,budget", [
    ("llama", 16), ("llama", 512), ("qwen2", 16), ("qwen2", 512), ("qwen3", 16), ("qwen3", 512),
    ("mistral", 16), ("llama3", 16)])
def test_greedy_matches_transformers(tiny_models, make_llm, arch, budget):
    path = tiny_models[arch]
    llm = make_llm(path, block_size=4, max_num_batched_tokens=budget)
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    results = llm.generate(PROMPTS, params)  # all prompts batched together
    for prompt, res in zip(PROMPTS, results, strict=True):
        assert res.token_ids == hf_greedy(path, prompt, 40), (arch, prompt)
        assert res.finish_reason == "length"


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_dtypes_run_and_mostly_agree(tiny_models, make_llm, dtype):
    # Half precision rounds differently from HF's fp32 run; the first tokens still agree.
    path = tiny_models["llama"]
    llm = make_llm(path, dtype=dtype, block_size=4)
    res = llm.generate(PROMPTS[:2], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    for prompt, r in zip(PROMPTS[:2], res, strict=True):
        assert len(r.token_ids) == 8
        assert r.token_ids[:3] == hf_greedy(path, prompt, 3)
    assert llm.engine.kv_cache.dtype == getattr(__import__("torch"), dtype)


def test_dummy_weights_from_a_config(tiny_models, make_llm, tmp_path):
    import json
    import shutil

    shutil.copy(f"{tiny_models['qwen3']}/config.json", tmp_path / "config.json")
    llm = make_llm(str(tmp_path), load_format="dummy", dtype="bfloat16", block_size=4)
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert llm.engine.model_cfg.num_layers == cfg["num_hidden_layers"]
    out = llm.generate(PROMPTS[:2], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
    assert [len(o.token_ids) for o in out] == [6, 6]
    assert all(0 <= t < cfg["vocab_size"] for o in out for t in o.token_ids)
