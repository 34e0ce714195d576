"""Greedy tokens equal HF transformers' on small random Llama, Qwen2 and Qwen3 models."""

from __future__ import annotations

import pytest
from tiny_models import PROMPTS, hf_greedy

from engine.sampling_params import SamplingParams


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize("budget", [16, 512])
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
