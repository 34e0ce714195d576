"""A KV pool too small for the batch forces preemption by recompute; tokens stay right."""

from __future__ import annotations

import pytest
from tiny_models import PROMPTS

from engine.sampling_params import SamplingParams


@pytest.mark.parametrize("defer", [True, False])
def test_tiny_pool_preempts_and_tokens_are_right(tiny_models, make_llm, defer):
    path = tiny_models["llama"]
    params = [SamplingParams(max_tokens=24, temperature=0, ignore_eos=True),
              SamplingParams(max_tokens=24, temperature=0.8, seed=5, ignore_eos=True,
                             repetition_penalty=1.3, frequency_penalty=0.4)] * 2
    prompts = PROMPTS
    ref = make_llm(path, block_size=4).generate(prompts, params)
    # 24 blocks of 4 = 96 slots; the four requests need 35 + 29 + 74 + 41 = 179 at the end.
    small = make_llm(path, block_size=4, num_kv_blocks=24, defer_output=defer)
    got = small.generate(prompts, params)
    assert small.engine.num_preemptions > 0
    for r, g in zip(ref, got, strict=True):
        assert g.token_ids == r.token_ids


def test_request_larger_than_pool_is_rejected(tiny_models, make_llm):
    llm = make_llm(tiny_models["llama"], block_size=4, num_kv_blocks=4, max_model_len=64)
    assert llm.engine.max_model_len == 16  # what the pool can hold is what is advertised
    with pytest.raises(ValueError, match="max_tokens"):
        llm.engine.add_request("big", PROMPTS[0], SamplingParams(max_tokens=10))
