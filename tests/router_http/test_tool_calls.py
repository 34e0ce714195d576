"""Tool calls read back from text (Hermes/Qwen and Llama 3 formats, forced choices), the
streamed deltas agreeing with the whole reply, and the request fields that ask for them."""

from __future__ import annotations

import json

import pytest

from router.http.http_errors import HttpError
from router.http.openai_request import parse_chat, parse_completion
from router.http.structured_request import ToolMode
from router.http.tool_parse import parse
from router.http.tool_stream import ToolStream

AUTO = ToolMode("auto")
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "parameters": {"type": "object", "properties": {
        "city": {"type": "string"}}, "required": ["city"]}}},
    {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}]
CHAT = {"messages": [{"role": "user", "content": "hi"}]}


def test_hermes_calls_after_text() -> None:
    text = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}'
            '\n</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>')
    content, calls = parse(text, AUTO)
    assert content.strip() == "Let me check."
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Oslo"}), ("get_time", {})]
    assert len({c.id for c in calls}) == 2


def test_llama3_json_calls() -> None:
    one = '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Rome"}}'
    assert [(c.name, c.arguments) for c in parse(one, AUTO)[1]] == [
        ("get_weather", '{"city": "Rome"}')]
    two = '{"name": "get_time", "parameters": {}}; {"name": "get_time", "parameters": {}}'
    assert [c.name for c in parse(two, AUTO)[1]] == ["get_time", "get_time"]


@pytest.mark.parametrize("text", ["Just text.", '{"not": "a call"}', "<tool_call>{oops",
                                  '{"name": "x", "parameters": {}} trailing'])
def test_anything_else_is_content(text: str) -> None:
    assert parse(text, AUTO) == (text, [])


def test_forced_choices() -> None:
    c = parse(' {"city": "Paris"}', ToolMode("named", "get_weather"))[1]
    assert [(x.name, x.arguments) for x in c] == [("get_weather", '{"city": "Paris"}')]
    c = parse('[{"name": "get_time", "arguments": {}}]', ToolMode("required"))[1]
    assert [x.name for x in c] == ["get_time"]


def _stream(text: str, mode: ToolMode, step: int) -> tuple[str, dict[int, dict]]:
    s = ToolStream(mode)
    content, calls = "", {}
    pieces = [text[i:i + step] for i in range(0, len(text), step)]
    outs = [s.feed(p) for p in pieces] + [s.finish()]
    for c, deltas in outs:
        content += c
        for d in deltas:
            acc = calls.setdefault(d["index"], {"name": "", "arguments": ""})
            acc["name"] += d.get("function", {}).get("name", "")
            acc["arguments"] += d.get("function", {}).get("arguments", "")
    return content, calls


@pytest.mark.parametrize("step", [1, 3, 7, 1000])
@pytest.mark.parametrize("text, mode", [
    ('Sure.<tool_call>{"name": "get_time", "arguments": {}}</tool_call>', AUTO),
    ('Text with < and <tool but no call.', AUTO),
    ('{"name": "get_weather", "parameters": {"city": "Oslo"}}', AUTO),
    ('{"city": "Oslo"}', ToolMode("named", "get_weather")),
    ('[{"name": "get_time", "arguments": {}}]', ToolMode("required")),
])
def test_streamed_deltas_add_up_to_the_whole_reply(text: str, mode: ToolMode,
                                                   step: int) -> None:
    content, calls = _stream(text, mode, step)
    want_content, want_calls = parse(text, mode)
    assert content == want_content
    assert [(c["name"], c["arguments"]) for c in calls.values()] == [
        (c.name, c.arguments) for c in want_calls]


def test_request_fields_become_a_grammar_and_tools() -> None:
    r = parse_chat({**CHAT, "tools": TOOLS, "tool_choice": {
        "type": "function", "function": {"name": "get_weather"}}})
    s = r.generate.sampling.structured
    assert s.kind == "json_schema" and json.loads(s.value)["required"] == ["city"]
    assert json.loads(r.generate.chat.tools_json) == TOOLS
    assert r.tools == ToolMode("named", "get_weather")
    assert r.structured_field == "tools[0].function.parameters"
    r = parse_chat({**CHAT, "tools": TOOLS, "tool_choice": "required"})
    assert json.loads(r.generate.sampling.structured.value)["minItems"] == 1
    r = parse_chat({**CHAT, "tools": TOOLS})  # auto: rendered, read back, not constrained
    assert r.tools == ToolMode("auto") and not r.generate.sampling.HasField("structured")
    r = parse_chat({**CHAT, "tools": TOOLS, "tool_choice": "none"})
    assert r.tools is None and not r.generate.chat.tools_json
    r = parse_chat({**CHAT, "response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object"}, "strict": True}}})
    assert r.generate.sampling.structured.kind == "json_schema"
    r = parse_completion({"prompt": "x", "structured_outputs": {"choice": ["a", "b"]}})
    assert json.loads(r.generate.sampling.structured.value) == ["a", "b"]


def test_assistant_tool_calls_in_history_are_carried() -> None:
    calls = [{"id": "c1", "type": "function",
              "function": {"name": "get_time", "arguments": "{}"}}]
    r = parse_chat({"messages": [{"role": "user", "content": "time?"},
                                 {"role": "assistant", "content": None, "tool_calls": calls},
                                 {"role": "tool", "content": "noon", "tool_call_id": "c1"}]})
    m = r.generate.chat.messages
    assert json.loads(m[1].tool_calls_json) == calls and m[2].tool_call_id == "c1"
    with pytest.raises(HttpError) as e:
        parse_chat({"messages": [{"role": "assistant", "tool_calls": [{"function": {}}]}]})
    assert e.value.param == "messages[0].tool_calls[0].function.name"


def test_the_chat_template_shows_tools_and_past_calls() -> None:
    """SmolLM2's template knows no tools: they go into the system message, and a past call
    into the assistant's turn, in the Hermes format the parser reads."""
    from router_fakes import load_tokenizer

    from router.requests.validation import prepare

    tok = load_tokenizer()
    calls = [{"id": "c1", "type": "function",
              "function": {"name": "get_time", "arguments": "{}"}}]
    r = parse_chat({"tools": TOOLS, "messages": [
        {"role": "user", "content": "time?"},
        {"role": "assistant", "content": None, "tool_calls": calls},
        {"role": "tool", "content": "noon", "tool_call_id": "c1"}]})
    prep = prepare(r.generate, tok, {"smollm2"}, max_tokens_limit=16)
    text = tok.decode(prep.prompt_token_ids, skip_special_tokens=False)
    assert "<tools>" in text and '"get_weather"' in text
    assert '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>' in text
    assert text.index("<tools>") < text.index("time?") < text.index("noon")


def test_a_bad_schema_is_refused_by_the_router_naming_it() -> None:
    from router_fakes import load_tokenizer

    from router.requests.errors import RequestError
    from router.requests.validation import prepare

    r = parse_chat({**CHAT, "response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object", "properties": {"a": {"type": "strin"}}}}}})
    with pytest.raises(RequestError) as e:
        prepare(r.generate, load_tokenizer(), {"smollm2"}, max_tokens_limit=16)
    assert e.value.message.startswith("sampling.structured: ") and "strin" in e.value.message
