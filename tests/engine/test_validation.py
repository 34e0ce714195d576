"""Bad requests raise ValueError naming the field; other requests keep running."""

from __future__ import annotations

import pytest
from tiny_models import PROMPTS, hf_greedy

from engine.sampling_params import SamplingParams

BAD_PARAMS = [
    (dict(max_tokens=0), "max_tokens"),
    (dict(max_tokens=-3), "max_tokens"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.5), "top_p"),
    (dict(temperature=-0.1), "temperature"),
    (dict(stop=[3]), "stop"),
    (dict(stop={"a": 1}), "stop"),
    (dict(stop_token_ids=["x"]), "stop_token_ids"),
    (dict(min_p=2.0), "min_p"),
    (dict(top_k=-5), "top_k"),
    (dict(repetition_penalty=0.0), "repetition_penalty"),
    (dict(presence_penalty=3.0), "presence_penalty"),
    (dict(logprobs=99), "logprobs"),
    (dict(seed=-1), "seed"),
    (dict(min_tokens=5, max_tokens=2), "min_tokens"),
]


@pytest.mark.parametrize("kw,field", BAD_PARAMS)
def test_bad_sampling_params_name_the_field(kw, field):
    with pytest.raises(ValueError, match=f"^{field}:"):
        SamplingParams(**kw)


def test_bad_requests_rejected_while_others_run(tiny_models, make_llm):
    path = tiny_models["llama"]
    llm = make_llm(path, block_size=4, max_model_len=64)
    eng = llm.engine
    eng.add_request("good", PROMPTS[0], SamplingParams(max_tokens=20, temperature=0,
                                                       ignore_eos=True))
    tokens: list[int] = []
    for o in eng.step().outputs + eng.step().outputs:
        tokens += o.new_token_ids
    cases = [
        ([], SamplingParams(), "prompt"),  # empty prompt
        ([1] * 64, SamplingParams(max_tokens=1), "prompt"),  # over max_model_len
        ([1] * 40, SamplingParams(max_tokens=30), "max_tokens"),  # prompt + output too long
        ([999999], SamplingParams(), "prompt"),  # token id outside the vocabulary
    ]
    for prompt, params, field in cases:
        with pytest.raises(ValueError, match=f"^{field}:"):
            eng.add_request(f"bad-{field}", prompt, params)
    with pytest.raises(ValueError, match="^request_id:"):
        eng.add_request("good", PROMPTS[1], SamplingParams())
    while eng.has_unfinished():
        for o in eng.step().outputs:
            tokens += o.new_token_ids
    assert tokens == hf_greedy(path, PROMPTS[0], 20)


def test_bad_engine_config_names_the_flag(tiny_models, make_llm):
    for kw, flag in [(dict(block_size=0), "block_size"), (dict(role="boss"), "role"),
                     (dict(dtype="int8"), "dtype"), (dict(max_num_batched_tokens=0),
                                                     "max_num_batched_tokens")]:
        with pytest.raises(ValueError, match=f"^{flag}:"):
            make_llm(tiny_models["llama"], **kw)


def test_bounded_waiting_queue(tiny_models, make_llm):
    from engine.scheduler import QueueFull

    llm = make_llm(tiny_models["llama"], block_size=4, max_waiting=2)
    eng = llm.engine
    eng.add_request("a", PROMPTS[0], SamplingParams(max_tokens=2))
    eng.add_request("b", PROMPTS[1], SamplingParams(max_tokens=2))
    with pytest.raises(QueueFull):
        eng.add_request("c", PROMPTS[2], SamplingParams(max_tokens=2))
    assert "c" not in eng.requests
    while eng.has_unfinished():
        eng.step()


@pytest.mark.parametrize("after_steps", [0, 1, 3, 6])
def test_abort_in_every_state_frees_blocks(tiny_models, make_llm, after_steps):
    # budget 8 and a 50-token prompt: steps 1-6 prefill chunks, then decode.
    llm = make_llm(tiny_models["llama"], block_size=4, max_num_batched_tokens=8)
    eng = llm.engine
    eng.add_request("x", PROMPTS[2], SamplingParams(max_tokens=30, ignore_eos=True))
    eng.add_request("y", PROMPTS[0], SamplingParams(max_tokens=4, temperature=0,
                                                    ignore_eos=True))
    for _ in range(after_steps):
        eng.step()
    assert eng.abort("x")
    assert "x" not in eng.requests
    outs = []
    while eng.has_unfinished():
        outs += eng.step().outputs
    assert all(o.request_id == "y" for o in outs)
    assert sum(len(o.new_token_ids) for o in outs if o.request_id == "y") <= 4
    assert not eng.abort("x")
