"""The identity rule at engine level: prefill on a producer engine, copy its KV blocks into a
consumer engine's reserved blocks, continue there — same tokens and logprobs as colocated."""

from __future__ import annotations

import pytest
from tiny_models import PROMPTS

from engine.sampling_params import SamplingParams


@pytest.mark.parametrize("params", [
    SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=2),
    SamplingParams(max_tokens=12, temperature=0.9, top_p=0.9, seed=11, ignore_eos=True,
                   logprobs=1, frequency_penalty=0.5),
], ids=["greedy", "seeded"])
def test_producer_to_consumer_handoff_equals_colocated(tiny_models, make_llm, params):
    path = tiny_models["llama"]
    prompt = PROMPTS[2]  # 50 tokens: 13 blocks of 4, the last one partial
    ref = make_llm(path, block_size=4).generate([prompt], params)[0]

    prod = make_llm(path, block_size=4, role="producer", max_num_batched_tokens=16).engine
    cons = make_llm(path, block_size=4, role="consumer").engine
    prod.add_request("r", prompt, params)
    outs = []
    while not outs:
        outs = prod.step().outputs
    (t0,) = outs
    src = prod.requests["r"].block_ids
    dst = cons.reserve(len(prompt))
    assert dst is not None and len(dst) == len(src) == 13
    cons.kv_cache[dst] = prod.kv_cache[src]  # what the transfer layer does, block by block
    prod.release("r")
    cons.add_prefilled("r", prompt, params, dst, t0.new_token_ids[0], t0.new_logprobs[0])
    tokens, lps = list(t0.new_token_ids), list(t0.new_logprobs)
    while cons.has_unfinished():
        for o in cons.step().outputs:
            tokens += o.new_token_ids
            lps += o.new_logprobs
    assert tokens == ref.token_ids
    # Same rows, same alternatives; values agree to float32 rounding (the producer's
    # chunked prefill sums attention in another order than the one-chunk reference).
    assert len(lps) == len(ref.logprobs) == 12
    for got, want in zip(lps, ref.logprobs, strict=True):
        assert got.token_id == want.token_id
        assert [t for t, _ in got.top] == [t for t, _ in want.top]
        assert got.logprob == pytest.approx(want.logprob, abs=1e-4)
        assert [v for _, v in got.top] == pytest.approx([v for _, v in want.top], abs=1e-4)


def test_handoff_without_token0_logprobs_is_refused(tiny_models, make_llm):
    cons = make_llm(tiny_models["llama"], block_size=4, role="consumer").engine
    dst = cons.reserve(5)
    assert dst is not None
    with pytest.raises(ValueError, match="^first_logprob:"):
        cons.add_prefilled("r", PROMPTS[1], SamplingParams(logprobs=1), dst, 7)
    cons.unreserve(dst)
