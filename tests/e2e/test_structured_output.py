"""Structured output and tool calling on a live 1P1D cluster (SmolLM2): the official openai
client's parse() with a Pydantic model, tool-call round trips (streamed and not), bad
schemas refused with a 400 naming the field, and P/D output equal to the colocated engine's
token for token under a grammar (token 0 constrained on the producer, the rest on the
consumer after its matcher resumes from token 0)."""

from __future__ import annotations

import json
from collections.abc import Iterator

import openai
import pydantic
import pytest
from cluster_client import generate_all
from live_cluster import WORKER_ARGS, start_cluster
from pdserve.v1 import common_pb2

from deploy.cluster import LocalCluster
from engine.sampling_params import SamplingParams

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"], "additionalProperties": False}}}


class City(pydantic.BaseModel):
    name: str
    country: str
    population: int


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    c = start_cluster(tmp_path_factory, "grammar1p1d", http_port=0,
                      worker_args=(*WORKER_ARGS, "--max-model-len", "1024"))
    yield c
    c.stop()


def _client(cluster: LocalCluster) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://127.0.0.1:{cluster.http_port}/v1", api_key="x",
                         max_retries=0)


def test_parse_returns_a_pydantic_object(cluster: LocalCluster) -> None:
    oa = _client(cluster)
    model = oa.models.list().data[0].id
    r = oa.beta.chat.completions.parse(
        model=model, temperature=0, max_tokens=120, response_format=City,
        messages=[{"role": "user", "content": "Describe Paris as JSON: name, country, "
                                              "population."}])
    city = r.choices[0].message.parsed
    assert isinstance(city, City), r.choices[0].message.content
    assert r.choices[0].finish_reason == "stop"
    assert City.model_validate_json(r.choices[0].message.content or "") == city


def test_json_object_and_choice(cluster: LocalCluster) -> None:
    oa = _client(cluster)
    r = oa.chat.completions.create(
        model="smollm2", temperature=0, max_tokens=120, response_format={"type": "json_object"},
        messages=[{"role": "user", "content": 'Reply with the JSON object {"x": 1}.'}])
    assert r.choices[0].finish_reason == "stop", r.choices[0].message.content
    assert isinstance(json.loads(r.choices[0].message.content or ""), dict)
    r = oa.chat.completions.create(model="smollm2", temperature=0.8, seed=5, max_tokens=10,
                                   extra_body={"structured_outputs": {"choice": ["yes", "no"]}},
                                   messages=[{"role": "user", "content": "Is water wet?"}])
    assert r.choices[0].message.content in ("yes", "no")


@pytest.mark.parametrize("choice", ["required", "named"])
def test_tool_call_round_trip(cluster: LocalCluster, choice: str) -> None:
    oa = _client(cluster)
    msgs: list = [{"role": "user", "content": "What is the weather in Oslo?"}]
    tc = "required" if choice == "required" else \
        {"type": "function", "function": {"name": "get_weather"}}
    r = oa.chat.completions.create(model="smollm2", temperature=0, max_tokens=60,
                                   messages=msgs, tools=[WEATHER], tool_choice=tc)
    ch = r.choices[0]
    assert ch.finish_reason == "tool_calls", ch
    calls = ch.message.tool_calls
    assert calls and calls[0].function.name == "get_weather"
    args = json.loads(calls[0].function.arguments)
    assert isinstance(args["city"], str)
    msgs += [{"role": "assistant", "content": None, "tool_calls": [c.model_dump()
                                                                    for c in calls]},
             {"role": "tool", "tool_call_id": calls[0].id, "content": "Sunny, 21 C"}]
    r = oa.chat.completions.create(model="smollm2", temperature=0, max_tokens=40,
                                   messages=msgs, tools=[WEATHER], tool_choice="none")
    assert r.choices[0].message.content and not r.choices[0].message.tool_calls


def test_streamed_tool_calls(cluster: LocalCluster) -> None:
    oa = _client(cluster)
    kw = dict(model="smollm2", temperature=0, max_tokens=60, tools=[WEATHER],
              messages=[{"role": "user", "content": "Weather in Rome?"}])
    whole = oa.chat.completions.create(**kw, tool_choice="required")  # type: ignore[call-overload]
    name, args, finish = "", "", None
    for chunk in oa.chat.completions.create(**kw, tool_choice="required",  # type: ignore[call-overload]
                                            stream=True):
        ch = chunk.choices[0]
        for d in ch.delta.tool_calls or []:
            name += (d.function.name or "") if d.function else ""
            args += (d.function.arguments or "") if d.function else ""
        finish = ch.finish_reason or finish
    want = whole.choices[0].message.tool_calls[0].function
    assert finish == "tool_calls" and (name, args) == (want.name, want.arguments)


@pytest.mark.parametrize("body, param", [
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object", "properties": {"a": {"type": "strin"}}}}}},
     "response_format"),
    ({"tools": [{**WEATHER, "function": {**WEATHER["function"], "parameters": {
        "type": "object", "properties": {"a": {"$ref": "#/nowhere"}}}}}],
      "tool_choice": "required"}, "tools"),
    ({"extra_body": {"structured_outputs": {"regex": "(("}}}, "structured_outputs"),
])
def test_bad_schemas_get_a_400_naming_the_field(cluster: LocalCluster, body: dict,
                                                param: str) -> None:
    oa = _client(cluster)
    with pytest.raises(openai.BadRequestError) as e:
        oa.chat.completions.create(model="smollm2", max_tokens=8, **body,
                                   messages=[{"role": "user", "content": "hi"}])
    assert e.value.body["param"] == param, e.value.body  # type: ignore[index]
    # the cluster keeps serving
    r = oa.chat.completions.create(model="smollm2", max_tokens=2,
                                   messages=[{"role": "user", "content": "hi"}])
    assert r.choices[0].finish_reason in ("stop", "length")


SCHEMA = {"type": "object", "properties": {
    "answer": {"type": "string", "maxLength": 40}, "confidence": {"type": "integer",
                                                                 "minimum": 0, "maximum": 100},
    "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3}},
    "required": ["answer", "confidence", "tags"], "additionalProperties": False}
QUESTIONS = ["What is the capital of France?", "Why is the sky blue?", "Name a planet.",
             "Who wrote Hamlet?"]


@pytest.mark.parametrize("seeded", [False, True], ids=["greedy", "seeded"])
def test_pd_equals_colocated_under_a_grammar(cluster: LocalCluster, colocated_llm,  # type: ignore[no-untyped-def]
                                             seeded: bool) -> None:
    tok = colocated_llm.tokenizer
    prompts = [tok.encode_chat([{"role": "user", "content": q + " Reply in JSON."}])
               for q in QUESTIONS]
    spec = {"kind": "json_schema", "value": json.dumps(SCHEMA)}

    def sampling(i: int) -> dict:
        s = dict(max_tokens=48, structured=spec)
        return {**s, **(dict(temperature=0.9, top_p=0.95, seed=70 + i) if seeded
                        else dict(temperature=0.0))}

    results = generate_all(cluster.router_address, prompts, sampling)
    ref = colocated_llm.generate(prompts, [SamplingParams(**sampling(i))
                                           for i in range(len(prompts))])
    for i, (r, c) in enumerate(zip(results, ref, strict=True)):
        assert r.code is None and r.error == "", (i, r.code, r.details, r.error)
        assert r.token_ids == c.token_ids, i
        assert len(r.token_ids) > 1  # decoded on the consumer past token 0
        if r.finish_reason == common_pb2.FINISH_REASON_STOP:
            json.loads(r.text)
