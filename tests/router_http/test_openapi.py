"""/openapi.json of a real router process (`pdserve router`, no workers: the document needs
none): a valid OpenAPI 3.0 document that lists what the HTTP door accepts and returns for
structured output and tool calls (response_format, structured_outputs, tools, tool_choice,
tool messages, message.tool_calls / delta.tool_calls, finish_reason "tool_calls"), with
their types, checked field by field and by validating request and reply bodies against it."""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

import jsonschema
import pytest
from schemathesis.specs.openapi.definitions import OPENAPI_30

from deploy.ports import free_port

REF = "#/components/schemas/"


@pytest.fixture(scope="module")
def doc() -> Iterator[dict[str, Any]]:
    grpc_port, http_port = free_port("127.0.0.1"), free_port("127.0.0.1")
    proc = subprocess.Popen([sys.executable, "-m", "deploy.cli", "router", "--host", "127.0.0.1",
                             "--grpc-port", str(grpc_port), "--http-port", str(http_port)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        url = f"http://127.0.0.1:{http_port}/openapi.json"
        end = time.monotonic() + 60
        while True:
            assert proc.poll() is None, proc.communicate()[0].decode(errors="replace")
            try:
                with urllib.request.urlopen(url, timeout=5) as r:
                    assert r.status == 200 and r.headers["Content-Type"].startswith(
                        "application/json")
                    yield json.loads(r.read())
                    break
            except (urllib.error.URLError, ConnectionError):
                assert time.monotonic() < end, "the router's HTTP port never answered"
                time.sleep(0.2)
    finally:
        proc.terminate()
        proc.wait(15)


def _json_schema(s: Any) -> Any:
    """OpenAPI 3.0's schema dialect as JSON Schema draft 4: ``nullable`` beside a ``type``
    admits null."""
    if isinstance(s, list):
        return [_json_schema(x) for x in s]
    if not isinstance(s, dict):
        return s
    out = {k: _json_schema(v) for k, v in s.items() if k != "nullable"}
    if s.get("nullable") and "type" in s:
        out["type"] = [s["type"], "null"]
        if "enum" in s:
            out["enum"] = [*s["enum"], None]
    return out


def _validator(doc: dict[str, Any], name: str) -> jsonschema.Draft4Validator:
    comps = {"components": _json_schema(doc["components"])}
    return jsonschema.Draft4Validator({**comps, "$ref": REF + name})


def _ok(doc: dict[str, Any], name: str, body: Any) -> None:
    errors = [e.message for e in _validator(doc, name).iter_errors(body)]
    assert not errors, (name, body, errors)


def _bad(doc: dict[str, Any], name: str, body: Any) -> None:
    assert not _validator(doc, name).is_valid(body), (name, body)


def _schema(doc: dict[str, Any], name: str) -> dict[str, Any]:
    out: dict[str, Any] = doc["components"]["schemas"][name]
    return out


def test_the_document_is_valid_openapi_3_0(doc: dict[str, Any]) -> None:
    assert doc["openapi"].startswith("3.0.")
    errors = [f"{list(e.path)}: {e.message}"
              for e in jsonschema.Draft4Validator(OPENAPI_30).iter_errors(doc)]
    assert not errors, errors[:5]
    # every reference resolves to a schema of the document
    refs = set()

    def walk(x: Any) -> None:
        if isinstance(x, dict):
            if "$ref" in x:
                refs.add(x["$ref"])
            for v in x.values():
                walk(v)
        elif isinstance(x, list):
            for v in x:
                walk(v)
    walk(doc)
    assert refs and all(r.startswith(REF) and r[len(REF):] in doc["components"]["schemas"]
                        for r in refs), refs


def test_structured_output_fields_and_their_types(doc: dict[str, Any]) -> None:
    chat = _schema(doc, "ChatCompletionRequest")["properties"]
    kinds = {k["properties"]["type"]["enum"][0]: k for k in chat["response_format"]["oneOf"]}
    assert set(kinds) == {"text", "json_object", "json_schema"}
    js = kinds["json_schema"]
    assert js["required"] == ["type", "json_schema"]
    assert js["properties"]["json_schema"]["properties"]["strict"] == {"type": "boolean"}
    assert {b["type"] for b in js["properties"]["json_schema"]["properties"]["schema"]["oneOf"]} \
        == {"object", "boolean"}
    for req in ("ChatCompletionRequest", "CompletionRequest"):
        so = _schema(doc, req)["properties"]["structured_outputs"]
        assert so["type"] == "object" and so["maxProperties"] == 1
        assert so["additionalProperties"] is False
        p = so["properties"]
        assert set(p) == {"json", "regex", "choice", "grammar", "json_object"}
        assert p["regex"] == {"type": "string", "minLength": 1}
        assert p["grammar"]["type"] == "string"
        assert p["choice"]["type"] == "array" and p["choice"]["items"]["type"] == "string"
        assert p["json_object"] == {"type": "boolean", "enum": [True]}

    _ok(doc, "ChatCompletionRequest", {
        "messages": [{"role": "user", "content": "a person as JSON"}],
        "response_format": {"type": "json_schema", "json_schema": {
            "name": "person", "strict": True,
            "schema": {"type": "object", "properties": {"name": {"type": "string"}}}}}})
    _ok(doc, "ChatCompletionRequest", {"messages": [{"role": "user", "content": "x"}],
                                       "response_format": {"type": "json_object"}})
    _bad(doc, "ChatCompletionRequest", {"messages": [{"role": "user", "content": "x"}],
                                        "response_format": {"type": "yaml"}})
    _bad(doc, "ChatCompletionRequest", {"messages": [{"role": "user", "content": "x"}],
                                        "response_format": {"type": "json_schema"}})
    for so in ({"regex": "[0-9]+"}, {"choice": ["yes", "no"]}, {"json_object": True},
               {"grammar": 'start: "a"+'}, {"json": {"type": "integer"}}):
        _ok(doc, "CompletionRequest", {"prompt": "x", "structured_outputs": so})
    for so in ({"regex": "a", "choice": ["b"]}, {"choice": []}, {"regex": ""}, {},
               {"json_object": False}, {"lark": "start: x"}):
        _bad(doc, "CompletionRequest", {"prompt": "x", "structured_outputs": so})


def test_tool_fields_messages_and_replies_and_their_types(doc: dict[str, Any]) -> None:
    chat = _schema(doc, "ChatCompletionRequest")["properties"]
    assert chat["tools"]["type"] == "array" and chat["tools"]["items"] == {"$ref": REF + "Tool"}
    fn = _schema(doc, "Tool")["properties"]["function"]
    assert fn["required"] == ["name"] and fn["properties"]["parameters"]["type"] == "object"
    assert fn["properties"]["name"]["pattern"] == "^[A-Za-z0-9_.-]{1,64}$"
    assert chat["tool_choice"] == {"$ref": REF + "ToolChoice"}
    choice = _schema(doc, "ToolChoice")["oneOf"]
    assert choice[0] == {"type": "string", "enum": ["none", "auto", "required"]}
    assert choice[1]["properties"]["function"]["required"] == ["name"]
    # messages: one schema per role; a tool message needs the id of the call it answers
    assert chat["messages"]["items"] == {"$ref": REF + "ChatMessage"}
    tool_msg = _schema(doc, "ToolMessage")
    assert tool_msg["properties"]["role"]["enum"] == ["tool"]
    assert tool_msg["required"] == ["role", "tool_call_id"]
    assert tool_msg["properties"]["tool_call_id"]["type"] == "string"
    assert _schema(doc, "AssistantMessage")["properties"]["tool_calls"]["items"] == \
        {"$ref": REF + "ToolCall"}
    call = _schema(doc, "ToolCall")
    assert call["required"] == ["id", "type", "function"]
    assert call["properties"]["function"]["properties"]["arguments"]["type"] == "string"
    # replies: message.tool_calls, delta.tool_calls, finish_reason "tool_calls"
    reply = _schema(doc, "ChatCompletionChoice")["properties"]
    assert reply["message"]["properties"]["tool_calls"]["items"] == {"$ref": REF + "ToolCall"}
    assert reply["message"]["properties"]["content"] == {
        "type": "string", "nullable": True,
        "description": "null when the reply is only tool calls"}
    assert "tool_calls" in reply["finish_reason"]["enum"]
    chunk = _schema(doc, "ChatCompletionChunkChoice")["properties"]
    assert chunk["delta"]["properties"]["tool_calls"]["items"] == \
        {"$ref": REF + "ToolCallDelta"}
    assert "tool_calls" in chunk["finish_reason"]["enum"]
    assert _schema(doc, "ToolCallDelta")["required"] == ["index"]
    assert "tool_calls" not in _schema(doc, "CompletionChoice")["properties"][
        "finish_reason"]["enum"]

    weather = {"type": "function", "function": {
        "name": "get_weather", "description": "The weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}
    call_ = {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}
    conversation = [
        {"role": "developer", "content": "Use tools."},
        {"role": "user", "content": [{"type": "text", "text": "Weather in Oslo?"}]},
        {"role": "assistant", "content": None, "tool_calls": [call_]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 3}'}]
    for tc in ("auto", "none", "required", {"type": "function",
                                            "function": {"name": "get_weather"}}):
        _ok(doc, "ChatCompletionRequest", {"messages": conversation, "tools": [weather],
                                           "tool_choice": tc, "parallel_tool_calls": False})
    _bad(doc, "ChatCompletionRequest", {"messages": [{"role": "tool", "content": "3"}]})
    _bad(doc, "ChatCompletionRequest", {"messages": conversation, "tool_choice": "maybe"})
    _bad(doc, "ChatCompletionRequest", {"messages": conversation, "tools": [
        {"type": "function", "function": {"name": "no spaces allowed"}}]})
    _bad(doc, "ChatCompletionRequest", {"messages": conversation, "tools": [
        {"type": "retrieval"}]})

    # reply bodies as router/http/openai_response.py writes them
    envelope = {"id": "chatcmpl-1", "created": 1, "model": "m"}
    usage = {"prompt_tokens": 9, "completion_tokens": 7, "total_tokens": 16,
             "prompt_tokens_details": {"cached_tokens": 0}}
    _ok(doc, "ChatCompletion", {**envelope, "object": "chat.completion", "usage": usage,
                                "choices": [{"index": 0, "logprobs": None,
                                             "finish_reason": "tool_calls", "message": {
                                                 "role": "assistant", "content": None,
                                                 "tool_calls": [call_]}}]})
    _bad(doc, "ChatCompletion", {**envelope, "object": "chat.completion", "usage": usage,
                                 "choices": [{"index": 0, "finish_reason": "called_tools",
                                              "message": {"role": "assistant",
                                                          "content": "x"}}]})
    for delta, finish in (({"role": "assistant", "content": ""}, None),
                          ({"tool_calls": [{"index": 0, **call_}]}, None),
                          ({"tool_calls": [{"index": 0, "function": {"arguments": "}"}}]},
                           "tool_calls")):
        _ok(doc, "ChatCompletionChunk", {**envelope, "object": "chat.completion.chunk",
                                         "usage": None, "choices": [{
                                             "index": 0, "delta": delta, "logprobs": None,
                                             "finish_reason": finish}]})
    _bad(doc, "ChatCompletionChunk", {**envelope, "object": "chat.completion.chunk",
                                      "choices": [{"index": 0, "finish_reason": None,
                                                   "delta": {"tool_calls": [call_]}}]})
