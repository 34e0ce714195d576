"""A migrated request resumes after the tokens its client already has: given as
output tokens (not prompt), they leave penalties, min_tokens, max_tokens, stop strings,
logprobs and the (seed, position) randomness exactly as in the run that never stopped."""

from __future__ import annotations

import pytest
from tiny_models import PROMPTS

from engine.sampling_params import SamplingParams

PARAMS = [
    SamplingParams(max_tokens=14, temperature=0, ignore_eos=True, logprobs=2),
    SamplingParams(max_tokens=14, temperature=0.9, top_p=0.9, seed=11, ignore_eos=True,
                   logprobs=1, frequency_penalty=0.7, presence_penalty=0.3,
                   repetition_penalty=1.3),
    SamplingParams(max_tokens=14, temperature=1.0, seed=5, min_tokens=10),
]
IDS = ["greedy", "seeded-penalties", "seeded-min-tokens"]


def _run(engine, rid, prompt, params, prior=None):  # type: ignore[no-untyped-def]
    engine.add_request(rid, prompt, params, prior_output_ids=prior)
    tokens, lps, text, finish = [], [], "", None
    while engine.has_unfinished():
        for o in engine.step().outputs:
            tokens += o.new_token_ids
            lps += o.new_logprobs
            text += o.new_text
            finish = o.finish_reason
    return tokens, lps, text, finish


@pytest.mark.parametrize("params", PARAMS, ids=IDS)
def test_colocated_resume_continues_the_unfailed_run(tiny_models, make_llm, params):
    engine = make_llm(tiny_models["llama"], block_size=4).engine
    prompt = PROMPTS[2]
    ref, ref_lps, _, ref_finish = _run(engine, "ref", prompt, params)
    assert len(ref) >= 6
    for k in (1, 5, len(ref) - 1):
        got, lps, _, finish = _run(engine, f"r{k}", prompt, params, prior=ref[:k])
        assert got == ref[k:], k
        assert finish == ref_finish
        assert [r.token_id for r in lps] == [r.token_id for r in ref_lps[k:]]
        for a, b in zip(lps, ref_lps[k:], strict=True):
            assert a.logprob == pytest.approx(b.logprob, abs=1e-4)


@pytest.mark.parametrize("params", PARAMS[:2], ids=IDS[:2])
def test_pd_resume_producer_then_consumer(tiny_models, make_llm, params):
    """The P/D target: the producer prefills prompt + prior and samples the next token, the
    consumer takes the KV of all of them and goes on."""
    path = tiny_models["llama"]
    prompt = PROMPTS[2]
    ref, ref_lps, _, _ = _run(make_llm(path, block_size=4).engine, "ref", prompt, params)
    k = 6
    prod = make_llm(path, block_size=4, role="producer", max_num_batched_tokens=16).engine
    cons = make_llm(path, block_size=4, role="consumer").engine
    prod.add_request("r", prompt, params, prior_output_ids=ref[:k])
    outs = []
    while not outs:
        outs = prod.step().outputs
    (t0,) = outs
    assert t0.new_token_ids == [ref[k]]
    assert not prod.has_unfinished()  # stopped after one token, holding its blocks
    src = prod.requests["r"].block_ids
    dst = cons.reserve(len(prompt) + k)
    assert dst is not None and len(dst) == len(src)
    cons.kv_cache[dst] = prod.kv_cache[src]
    prod.release("r")
    cons.add_prefilled("r", prompt, params, dst, t0.new_token_ids[0], t0.new_logprobs[0],
                       prior_output_ids=ref[:k])
    tokens = list(t0.new_token_ids)
    while cons.has_unfinished():
        for o in cons.step().outputs:
            tokens += o.new_token_ids
    assert tokens == ref[k:]


def test_resume_keeps_text_and_stop_strings(make_llm):
    """Text continues where the client's left off and a stop string spanning the migration
    point still stops (SmolLM2: a real tokenizer)."""
    llm = make_llm(None, max_num_batched_tokens=128)
    prompt = llm.encode("Count from one to twenty: one, two, three,", chat=False)
    free = SamplingParams(max_tokens=16, temperature=0)
    ref, _, ref_text, _ = _run(llm.engine, "ref", prompt, free)
    assert len(ref) == 16
    k = 5
    got, _, text, _ = _run(llm.engine, "r", prompt, free, prior=ref[:k])
    assert got == ref[k:]
    head = llm.tokenizer.decode(ref[:k])
    assert head + text == ref_text
    # a stop string whose start lies before the migration point and whose end after it
    stop = ref_text[len(head) - 2:len(head) + 3]
    params = SamplingParams(max_tokens=16, temperature=0, stop=[stop])
    want, _, want_text, want_finish = _run(llm.engine, "s-ref", prompt, params)
    got, _, text, finish = _run(llm.engine, "s", prompt, params, prior=want[:k])
    assert finish == want_finish == "stop"
    assert got == want[k:]
    assert want_text.endswith(text)


def test_bad_prior_outputs_are_refused_by_field(tiny_models, make_llm):
    engine = make_llm(tiny_models["llama"], block_size=4).engine
    p = SamplingParams(max_tokens=4)
    with pytest.raises(ValueError, match="^prior_output_ids:.*max_tokens"):
        engine.add_request("a", PROMPTS[1], p, prior_output_ids=[1, 2, 3, 4])
    with pytest.raises(ValueError, match="^prior_output_ids: token ids"):
        engine.add_request("b", PROMPTS[1], p, prior_output_ids=[10 ** 9])
    assert not engine.requests
