"""Chunked prefill under several budgets, and mixed batches, give the unchunked tokens."""

from __future__ import annotations

import pytest
from tiny_models import PROMPTS

from engine.sampling_params import SamplingParams

GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
LONG = [(7 * i + 3) % 250 for i in range(37)]  # 37 tokens: not a multiple of the block size


def test_chunk_budgets_match_unchunked(tiny_models, make_llm):
    path = tiny_models["llama"]
    ref = make_llm(path, block_size=8, max_num_batched_tokens=512).generate([LONG], GREEDY)[0]
    for budget in (8, 13, 37):  # one block, a non-multiple of the block size, whole prompt
        llm = make_llm(path, block_size=8, max_num_batched_tokens=budget)
        steps = []
        llm.engine.trace = lambda ev, n, steps=steps: steps.append(ev)
        got = llm.generate([LONG], GREEDY)[0]
        assert got.token_ids == ref.token_ids, budget
        # The prompt really was split: ceil(37 / budget) prefill launches before token 1.
        assert steps.count("launch") == -(-37 // budget) + GREEDY.max_tokens - 1


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_mixed_batch_equals_alone(tiny_models, make_llm, arch):
    path = tiny_models[arch]
    prompts = PROMPTS + [LONG]
    llm = make_llm(path, block_size=4, max_num_batched_tokens=20)
    together = llm.generate(prompts, GREEDY)
    for prompt, t in zip(prompts, together, strict=True):
        alone = llm.generate([prompt], GREEDY)[0]
        assert t.token_ids == alone.token_ids


def test_prompt_exact_block_multiple(tiny_models, make_llm):
    path = tiny_models["llama"]
    prompt = LONG[:32]  # 4 blocks of 8 exactly: token 0's KV starts a fresh block
    a = make_llm(path, block_size=8, max_num_batched_tokens=8).generate([prompt], GREEDY)[0]
    b = make_llm(path, block_size=16, max_num_batched_tokens=512).generate([prompt], GREEDY)[0]
    assert a.token_ids == b.token_ids
