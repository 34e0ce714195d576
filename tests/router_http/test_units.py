"""Pure pieces of the front door: OpenAI body parsing, error mapping, admission, orphans."""

from __future__ import annotations

import asyncio
from typing import Any

import grpc
import pytest

from router.http.http_errors import HttpError, from_request_error, rename_fields
from router.http.openai_request import parse_chat, parse_completion
from router.requests.admission import Admission
from router.requests.errors import Overloaded, RequestError
from worker.orphans import exhausted_by_orphans

CHAT = {"messages": [{"role": "user", "content": "hi"}]}


@pytest.mark.parametrize("body, param", [
    ([], "body"),
    ({}, "messages"),
    ({"messages": "hi"}, "messages"),
    ({"messages": [3]}, "messages[0]"),
    ({"messages": [{"role": 1, "content": "x"}]}, "messages[0].role"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
     "messages[0].content[0]"),
    ({**CHAT, "n": 2}, "n"),
    ({**CHAT, "temperature": "hot"}, "temperature"),
    ({**CHAT, "temperature": 2.5}, "temperature"),
    ({**CHAT, "top_p": True}, "top_p"),
    ({**CHAT, "max_tokens": 0}, "max_tokens"),
    ({**CHAT, "max_tokens": 2**40}, "max_tokens"),
    ({**CHAT, "max_completion_tokens": -1}, "max_completion_tokens"),
    ({**CHAT, "seed": -1}, "seed"),
    ({**CHAT, "stop": [1]}, "stop"),
    ({**CHAT, "stop": ["a"] * 17}, "stop"),
    ({**CHAT, "top_logprobs": 3}, "top_logprobs"),
    ({**CHAT, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({**CHAT, "presence_penalty": 1e400}, "presence_penalty"),
    ({**CHAT, "stream": "yes"}, "stream"),
    ({**CHAT, "stream_options": {"include_usage": 1}}, "stream_options.include_usage"),
    ({**CHAT, "tools": [{"type": "function"}]}, "tools"),
    ({**CHAT, "response_format": {"type": "json_object"}}, "response_format"),
    ({**CHAT, "logit_bias": {"1": 2}}, "logit_bias"),
    ({**CHAT, "model": 7}, "model"),
    ({"messages": [{"role": "tool", "content": "42"}]}, "messages[0].tool_call_id"),
    ({"messages": [{"role": "tool", "content": "42", "tool_call_id": 3}]},
     "messages[0].tool_call_id"),
])
def test_chat_body_errors_name_the_field(body: Any, param: str) -> None:
    with pytest.raises(HttpError) as e:
        parse_chat(body)
    assert e.value.status == 400 and e.value.param == param, e.value.message
    assert e.value.message.startswith(param + ":")


@pytest.mark.parametrize("body, param", [
    ({}, "prompt"), ({"prompt": ""}, "prompt"), ({"prompt": ["a", "b"]}, "prompt"),
    ({"prompt": [1, -2]}, "prompt"), ({"prompt": "x", "echo": True}, "echo"),
    ({"prompt": "x", "suffix": "y"}, "suffix"), ({"prompt": "x", "best_of": 2}, "best_of"),
    ({"prompt": "x", "logprobs": 6}, "logprobs"),
])
def test_completion_body_errors_name_the_field(body: Any, param: str) -> None:
    with pytest.raises(HttpError) as e:
        parse_completion(body)
    assert e.value.status == 400 and e.value.param == param, e.value.message


def test_bodies_map_to_the_grpc_request() -> None:
    r = parse_chat({**CHAT, "model": "smollm2", "max_tokens": 9, "max_completion_tokens": 5,
                    "temperature": 0, "stop": "\n", "seed": 3, "logprobs": True,
                    "top_logprobs": 2, "stream": True, "stream_options": {"include_usage": True},
                    "messages": [{"role": "developer", "content": [
                        {"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]})
    g = r.generate
    assert r.chat and r.stream and r.include_usage and r.logprobs == 2 and r.model == "smollm2"
    assert g.chat.messages[0].role == "system" and g.chat.messages[0].content == "a\nb"
    s = g.sampling
    assert (s.max_tokens, s.temperature, list(s.stop), s.seed, s.logprobs) == (5, 0, ["\n"], 3, 2)
    c = parse_completion({"prompt": [[5, 6, 7]], "logprobs": 0, "ignore_eos": True,
                          "top_k": 4})
    assert list(c.generate.prompt_token_ids.ids) == [5, 6, 7] and c.logprobs == 0
    assert c.generate.sampling.ignore_eos and c.generate.sampling.top_k == 4
    assert not c.generate.sampling.HasField("max_tokens")


def test_router_errors_are_renamed_to_openai_fields() -> None:
    assert rename_fields("sampling.top_p: must be in (0, 1]", False) == (
        "top_p: must be in (0, 1]", "top_p")
    assert rename_fields("chat.messages[0].role: bad", True)[1] == "messages[0].role"
    assert rename_fields("prompt_token_ids[1]: outside", False)[1] == "prompt[1]"
    assert rename_fields("prompt: 300 tokens", True)[1] == "messages"
    e = from_request_error(Overloaded("overloaded", 0.2), chat=True)
    assert (e.status, e.headers["Retry-After"], e.type) == (429, "1", "rate_limit_error")
    e = from_request_error(RequestError(grpc.StatusCode.UNAVAILABLE, "no workers"), chat=True)
    assert e.status == 503 and e.param is None


def test_admission_bounds_running_and_queued_and_hands_slots_over_in_order() -> None:
    async def main() -> None:
        adm = Admission(max_running=2, max_queued=2, retry_after_s=1.5)
        order: list[int] = []
        gate = asyncio.Event()

        async def job(i: int) -> None:
            async with adm.slot():
                order.append(i)
                await gate.wait()

        tasks = [asyncio.create_task(job(i)) for i in range(4)]
        await asyncio.sleep(0.01)
        assert (adm.running, adm.queued) == (2, 2)
        with pytest.raises(Overloaded) as e:
            async with adm.slot():
                pass
        assert e.value.retry_after_s == 1.5 and "--max-queued-requests 2" in e.value.message
        tasks[2].cancel()  # a queued client leaves: its place is freed, nothing leaks
        await asyncio.sleep(0.01)
        assert adm.queued == 1
        gate.set()
        await asyncio.gather(*tasks, return_exceptions=True)
        assert order == [0, 1, 3] and (adm.running, adm.queued) == (0, 0)

    asyncio.run(main())


def test_a_stopped_waiter_leaves_the_queue_without_a_slot() -> None:
    async def main() -> None:
        adm = Admission(max_running=1, max_queued=2, retry_after_s=1.0)
        gate, stop = asyncio.Event(), asyncio.Event()
        got: list[tuple[str, bool]] = []

        async def job(name: str, until: asyncio.Event | None = None) -> None:
            async with adm.slot(until) as held:
                got.append((name, held))
                if held:
                    await gate.wait()

        tasks = [asyncio.create_task(job("a")), asyncio.create_task(job("b", stop)),
                 asyncio.create_task(job("c"))]
        await asyncio.sleep(0.01)
        assert (adm.running, adm.queued) == (1, 2)
        stop.set()  # b is aborted while queued: out at once, holding nothing
        await asyncio.sleep(0.01)
        assert got == [("a", True), ("b", False)] and (adm.running, adm.queued) == (1, 1)
        gate.set()
        await asyncio.gather(*tasks)
        assert got == [("a", True), ("b", False), ("c", True)]
        assert (adm.running, adm.queued) == (0, 0)

    asyncio.run(main())


def test_orphan_exhaustion_needs_a_full_pool_mostly_held_by_orphans() -> None:
    assert not exhausted_by_orphans(free=0, total=100, orphan_blocks=0)
    assert not exhausted_by_orphans(free=50, total=100, orphan_blocks=50)  # room left
    assert not exhausted_by_orphans(free=2, total=100, orphan_blocks=10)  # busy, not stuck
    assert exhausted_by_orphans(free=2, total=100, orphan_blocks=60)
    assert not exhausted_by_orphans(free=0, total=0, orphan_blocks=0)


@pytest.mark.parametrize("field", ["max_tokens", "max_completion_tokens"])
@pytest.mark.parametrize("value", [-1, 0, 10_000_000, 2**40])
def test_max_tokens_has_one_limit_and_one_message(field: str, value: int) -> None:
    with pytest.raises(HttpError) as e:
        parse_chat({**CHAT, field: value}, 1 << 20)
    assert e.value.message == f"{field}: must be in [1, 1048576], got {value}"
    with pytest.raises(HttpError) as e:
        parse_chat({**CHAT, field: 65}, 64)  # the router's --max-tokens-limit
    assert e.value.message == f"{field}: must be in [1, 64], got 65"
    assert parse_chat({**CHAT, field: 64}, 64).generate.sampling.max_tokens == 64


def test_tool_messages_follow_the_openai_spec() -> None:
    r = parse_chat({"messages": [
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": None},
        {"role": "tool", "content": "sunny", "tool_call_id": "call_1"}]})
    assert [m.role for m in r.generate.chat.messages] == ["user", "assistant", "tool"]
    assert r.generate.chat.messages[2].content == "sunny"


def test_the_chat_template_renders_a_tool_message() -> None:
    from router_fakes import load_tokenizer

    from router.requests.validation import prepare

    tok = load_tokenizer()
    r = parse_chat({"messages": [{"role": "user", "content": "weather?"},
                                 {"role": "tool", "content": "sunny", "tool_call_id": "c1"}]})
    prep = prepare(r.generate, tok, {"smollm2"}, max_tokens_limit=16)
    text = tok.decode(prep.prompt_token_ids, skip_special_tokens=False)
    assert "<|im_start|>tool\nsunny<|im_end|>" in text
    assert text.index("weather?") < text.index("sunny")


def test_unknown_fields_are_logged_once_per_field(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level("WARNING", logger="pdserve.router.http")
    for _ in range(3):
        parse_chat({**CHAT, "frobnicate": 1, "parallel_tool_calls": False, "user": "u1"})
        parse_completion({"prompt": "x", "frobnicate": 2})
    lines = [r.getMessage() for r in caplog.records]
    assert sum("'frobnicate'" in m for m in lines) == 1
    assert sum("'parallel_tool_calls'" in m for m in lines) == 1
    assert not any("'user'" in m for m in lines)  # a supported field (OpenAI's end-user tag)
    assert all("docs/http_api.md" in m for m in lines)
