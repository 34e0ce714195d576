"""Structured output in the engine: spec checks, the bitmask written into logits, matchers
that resume from tokens alone, and every output of fuzzed JSON schemas on a tiny random
model validating against its schema (jsonschema)."""

from __future__ import annotations

import json
import random
import re
from typing import Any

import pytest
import torch
from tiny_models import byte_tokenizer, make_tiny_model

from engine.grammar.compile import check_compiles
from engine.grammar.spec import check_spec
from engine.sampling_params import SamplingParams
from kernels.bitmask import apply_bitmask

# the GPU host lacks it; this module has no gpu test, so there it skips whole
jsonschema = pytest.importorskip("jsonschema")


def test_spec_errors_name_the_field() -> None:
    with pytest.raises(ValueError, match=r"structured.kind: must be one of"):
        check_spec({"kind": "yaml", "value": ""})
    with pytest.raises(ValueError, match=r"structured.value: the schema is not valid JSON"):
        check_spec({"kind": "json_schema", "value": "{"})
    with pytest.raises(ValueError, match=r"structured.value: choice must be a list"):
        check_spec({"kind": "choice", "value": "[1, 2]"})
    with pytest.raises(ValueError, match=r"structured.extra: unknown field"):
        check_spec({"kind": "regex", "value": "a", "extra": 1})
    with pytest.raises(ValueError, match=r"structured: .*strin"):
        check_compiles({"kind": "json_schema",
                        "value": '{"type": "object", "properties": {"a": {"type": "strin"}}}'})
    with pytest.raises(ValueError, match=r"structured: .*unclosed group"):
        check_compiles({"kind": "regex", "value": "(("})
    with pytest.raises(ValueError, match=r"structured: .*unknown name"):
        check_compiles({"kind": "grammar", "value": "start: foo"})
    check_compiles({"kind": "json_object", "value": ""})
    with pytest.raises(ValueError, match=r"structured.kind"):
        SamplingParams(structured={"kind": "nope"})


def test_bitmask_keeps_exactly_the_allowed_tokens() -> None:
    g = torch.Generator().manual_seed(0)
    s, v = 5, 77  # not a multiple of 32: the last word is partly padding
    allowed = torch.rand(s, v, generator=g) < 0.3
    words = torch.zeros(s, (v + 31) // 32, dtype=torch.int64)
    for t in range(v):
        words[:, t // 32] |= allowed[:, t].long() << (t % 32)
    words = torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32)
    logits = torch.randn(s, v, generator=g)
    out = apply_bitmask(logits, words)
    assert torch.equal(out[allowed], logits[allowed])
    assert torch.isneginf(out[~allowed]).all()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from engine.llm import LLM

    path = str(tmp_path_factory.mktemp("tiny_grammar"))
    make_tiny_model(path, "llama")
    byte_tokenizer(path)
    llm = LLM(path, max_num_seqs=16, max_num_batched_tokens=512)
    yield llm
    acc = llm.engine.block_accounting()
    assert acc.used == 0 and acc.free == acc.total


def _text(llm, ids: list[int]) -> str:
    """The output without its EOS: the tiny model's EOS (2) is a byte of the byte-level
    vocabulary ('#'), so its text would otherwise end the JSON."""
    if ids and ids[-1] in llm.engine.eos_token_ids:
        ids = ids[:-1]
    return llm.tokenizer.decode(ids)


def _leaf(rng: random.Random) -> dict[str, Any]:
    kind = rng.choice(["string", "integer", "boolean", "enum", "null", "number"])
    if kind == "string":
        return {"type": "string", "maxLength": rng.randint(0, 6)}
    if kind == "integer":
        lo = rng.randint(-50, 50)
        return {"type": "integer", "minimum": lo, "maximum": lo + rng.randint(0, 300)}
    if kind == "number":
        return {"type": "number", "minimum": 0, "maximum": 10}
    if kind == "enum":
        return {"enum": rng.sample(["red", "green", "blue", "a b", "x\"y"], rng.randint(1, 3))}
    return {"type": kind}


def _schema(rng: random.Random, depth: int = 0) -> dict[str, Any]:
    props: dict[str, Any] = {}
    for i in range(rng.randint(1, 4)):
        r = rng.random()
        if r < 0.2 and depth < 2:
            props[f"o{i}"] = _schema(rng, depth + 1)
        elif r < 0.4:
            props[f"a{i}"] = {"type": "array", "items": _leaf(rng), "maxItems": rng.randint(0, 3)}
        else:
            props[f"p{i}"] = _leaf(rng)
    req = [k for k in props if rng.random() < 0.7]
    return {"type": "object", "properties": props, "required": req,
            "additionalProperties": False}


def test_fuzzed_schemas_every_output_validates(tiny) -> None:
    """Random weights pick among the allowed tokens freely: whatever they pick, the text must
    parse and validate. Compact JSON (no free whitespace) keeps every grammar finite, so a
    random model cannot wander; max_tokens is far above any instance's length."""
    rng = random.Random(29)
    schemas = [_schema(rng) for _ in range(24)]
    params = []
    for i, s in enumerate(schemas):
        grammar_schema = {**s, "x-guidance": {"whitespace_flexible": False}}
        params.append(SamplingParams(max_tokens=400, temperature=1.0, seed=i,
                                     structured={"kind": "json_schema",
                                                 "value": json.dumps(grammar_schema)}))
    prompts = [[5 + i, 17, 33, 90] for i in range(len(schemas))]
    res = tiny.generate(prompts, params)
    for s, r in zip(schemas, res, strict=True):
        assert r.finish_reason == "stop", (s, r.text)
        jsonschema.validate(json.loads(_text(tiny, r.token_ids)), s)


def test_choice_and_regex_outputs(tiny) -> None:
    res = tiny.generate([[7, 8, 9]] * 6, [
        SamplingParams(max_tokens=20, temperature=1.0, seed=i,
                       structured={"kind": "choice", "value": '["alpha", "beta", "gamma"]'})
        for i in range(3)] + [
        SamplingParams(max_tokens=20, temperature=1.0, seed=i,
                       structured={"kind": "regex", "value": "[0-9]{3}-[a-f]{2}"})
        for i in range(3)])
    texts = [_text(tiny, r.token_ids) for r in res]
    assert all(t in ("alpha", "beta", "gamma") for t in texts[:3]), texts
    assert all(re.fullmatch("[0-9]{3}-[a-f]{2}", t) for t in texts[3:]), texts


def test_resumed_request_continues_the_grammar(tiny) -> None:
    """A request admitted with prior outputs (migration; the consumer's token 0 is the same
    path) continues exactly where an uninterrupted run went, grammar included."""
    spec = {"kind": "json_schema", "value": json.dumps(
        {**_schema(random.Random(3)), "x-guidance": {"whitespace_flexible": False}})}
    p = SamplingParams(max_tokens=300, temperature=1.0, seed=11, structured=spec)
    prompt = [5, 17, 33, 90, 12]
    whole = tiny.generate([prompt], p)[0]
    assert len(whole.token_ids) > 4
    eng = tiny.engine
    prior = whole.token_ids[:3]
    eng.add_request("resumed", prompt, p, prior_output_ids=prior)
    got: list[int] = []
    while eng.has_unfinished():
        for out in eng.step().outputs:
            got += out.new_token_ids
    assert prior + got == whole.token_ids


def test_an_eos_that_is_also_a_byte_never_ends_a_grammar_early(tiny) -> None:
    """The tiny model's EOS (2) is the byte '#', which a JSON string may hold: greedy
    decoding picked it inside a string until EOS was masked while the grammar cannot end."""
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8}},
              "required": ["name"], "additionalProperties": False,
              "x-guidance": {"whitespace_flexible": False}}
    spec = {"kind": "json_schema", "value": json.dumps(schema)}
    prompts = [[5 + i, 17, 33, 90, 12][: 2 + i % 4] for i in range(11)]
    res = tiny.generate(prompts, SamplingParams(max_tokens=60, temperature=0, structured=spec))
    for r in res:
        assert r.finish_reason == "stop"
        assert len(json.loads(_text(tiny, r.token_ids))["name"]) <= 8
