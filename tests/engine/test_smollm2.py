"""The embedded SmolLM2-135M-Instruct: greedy chat completions equal HF transformers'
(loading the same GGUF), stop handling on real text, and the CLI."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from engine.sampling_params import SamplingParams

CHATS = ["What is the capital of France?", "Write a haiku about the sea.",
         "Explain gravity in one sentence.", "List three colors."]


@pytest.fixture(scope="module")
def smol(request):
    from engine.llm import LLM

    llm = LLM(None, max_num_batched_tokens=64)  # small budget: the prompts are chunked
    yield llm
    acc = llm.engine.block_accounting()
    assert acc.used == 0 and acc.free == acc.total


def test_chat_greedy_matches_transformers(smol, hf_smollm2):
    res = smol.generate(CHATS, SamplingParams(max_tokens=48, temperature=0), chat=True)
    for r in res:
        ids = r.prompt_token_ids
        ref = hf_smollm2.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids),
                               dtype=torch.long), max_new_tokens=48,
                               do_sample=False)[0, len(ids):].tolist()
        assert r.token_ids == ref[: len(r.token_ids)]
        if r.finish_reason == "stop":  # stopped at EOS exactly where HF did
            assert r.token_ids[-1] in smol.engine.eos_token_ids and len(ref) == len(r.token_ids)
        else:
            assert len(r.token_ids) == 48
        assert r.text == smol.tokenizer.decode(r.token_ids)
    assert "Paris" in res[0].text


def test_stop_string_cuts_text_and_stream_never_shows_it(smol):
    p = SamplingParams(max_tokens=48, temperature=0, stop=[" is Paris"])
    streamed = ""
    last = None
    for out in smol.stream([CHATS[0]], p, chat=True):
        streamed += out.new_text
        last = out
    assert last is not None and last.finish_reason == "stop" and last.stop_reason == " is Paris"
    assert streamed == "The capital of France"
    keep = SamplingParams(max_tokens=48, temperature=0, stop=[" is Paris"],
                          include_stop_str_in_output=True)
    assert smol.generate([CHATS[0]], keep, chat=True)[0].text == "The capital of France is Paris"


def test_stop_token_min_tokens_and_logprobs(smol):
    base = smol.generate([CHATS[0]], SamplingParams(max_tokens=8, temperature=0), chat=True)[0]
    stop_tok = base.token_ids[2]
    r = smol.generate([CHATS[0]], SamplingParams(max_tokens=8, temperature=0,
                                                 stop_token_ids=[stop_tok]), chat=True)[0]
    assert r.token_ids == base.token_ids[:3] and r.finish_reason == "stop"
    # min_tokens holds EOS off: the answer runs past where it would have ended.
    short = smol.generate([CHATS[3]], SamplingParams(max_tokens=64, temperature=0), chat=True)[0]
    assert short.finish_reason == "stop"
    n = len(short.token_ids)
    longer = smol.generate([CHATS[3]], SamplingParams(max_tokens=n + 8, min_tokens=n + 4,
                                                      temperature=0), chat=True)[0]
    assert len(longer.token_ids) >= n + 4
    assert longer.token_ids[: n - 1] == short.token_ids[: n - 1]
    lp = smol.generate([CHATS[0]], SamplingParams(max_tokens=4, temperature=0, logprobs=3),
                       chat=True)[0]
    assert len(lp.logprobs) == 4
    for tok, entry in zip(lp.token_ids, lp.logprobs, strict=True):
        assert entry.token_id == tok and entry.logprob <= 0
        assert entry.top[0][0] == tok  # greedy: the sampled token is the most likely one
        assert len(entry.top) == 3 and entry.top[0][1] >= entry.top[1][1] >= entry.top[2][1]


def test_cli_generate_json():
    cmd = [sys.executable, "-m", "deploy.cli", "generate", "--prompt",
           "What is the capital of France?", "--chat", "--max-tokens", "12", "--json"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=True)
    obj = json.loads(out.stdout.strip().splitlines()[-1])
    assert obj["finish_reason"] in ("stop", "length") and "Paris" in obj["text"]
    assert len(obj["token_ids"]) == obj["num_output_tokens"] <= 12


def test_cli_rejects_bad_flag_value():
    cmd = [sys.executable, "-m", "deploy.cli", "generate", "--prompt", "hi", "--top-p", "0"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert out.returncode == 2 and "top_p" in out.stderr
