"""Seeded sampling: a pure function of (seed, position), whatever the batch or output mode."""

from __future__ import annotations

import torch
from tiny_models import PROMPTS

from engine.sampler import SamplingBatch, sample
from engine.sampling_params import SamplingParams
from kernels.random_draw import uniform_noise


def _params(seed: int) -> SamplingParams:
    return SamplingParams(max_tokens=16, temperature=1.0, seed=seed, ignore_eos=True)


def test_same_seed_same_tokens_across_batches_and_modes(tiny_models, make_llm):
    path = tiny_models["llama"]
    target = PROMPTS[1]
    alone = make_llm(path, block_size=4).generate([target], _params(7))[0].token_ids
    crowd = [PROMPTS[0], target, PROMPTS[2], PROMPTS[3]]
    for defer in (True, False):
        for budget in (6, 512):
            llm = make_llm(path, block_size=4, max_num_batched_tokens=budget, defer_output=defer)
            res = llm.generate(crowd, [_params(1), _params(7), _params(2), _params(3)])
            assert res[1].token_ids == alone, (defer, budget)


def test_different_seeds_differ(tiny_models, make_llm):
    llm = make_llm(tiny_models["llama"], block_size=4)
    outs = {tuple(llm.generate([PROMPTS[0]], _params(s))[0].token_ids) for s in range(4)}
    assert len(outs) == 4


def test_unseeded_requests_are_random(tiny_models, make_llm):
    llm = make_llm(tiny_models["llama"], block_size=4)
    p = SamplingParams(max_tokens=16, temperature=1.0, ignore_eos=True)
    outs = {tuple(r.token_ids) for r in llm.generate([PROMPTS[0]] * 4, p)}
    assert len(outs) > 1


def test_noise_is_pure_function_of_seed_and_position():
    a = uniform_noise(torch.tensor([5, 5, 6]), torch.tensor([10, 11, 10]), 1000)
    b = uniform_noise(torch.tensor([6, 5]), torch.tensor([10, 10]), 1000)
    assert torch.equal(a[0], b[1]) and torch.equal(a[2], b[0])
    assert not torch.equal(a[0], a[1]) and not torch.equal(a[0], a[2])
    assert float(a.min()) > 0 and float(a.max()) < 1
    assert abs(float(a.mean()) - 0.5) < 0.02  # uniform: mean 1/2


def _batch(n: int, **kw) -> SamplingBatch:
    base = dict(temperature=torch.ones(n), top_k=torch.zeros(n, dtype=torch.int64),
                top_p=torch.ones(n), min_p=torch.zeros(n),
                seeds=torch.arange(n, dtype=torch.int64) + 123,
                positions=torch.full((n,), 9, dtype=torch.int64), all_greedy=False,
                any_top_k=False, any_top_p=False, any_min_p=False)
    base.update(kw)
    return SamplingBatch(**base)


def test_draws_follow_the_distribution():
    probs = torch.tensor([0.1, 0.2, 0.3, 0.4])
    n = 20000
    logits = probs.log().repeat(n, 1)
    counts = torch.bincount(sample(logits, _batch(n)).token_ids, minlength=4).float() / n
    assert torch.allclose(counts, probs, atol=0.015), counts
