"""The HTTP front door answers any JSON body with a response, never a 500: text that is
not Unicode (a lone surrogate, sent as the JSON escape "\\ud800") is a 400 naming the
field, and NUL is ordinary text. A real router on scripted fake workers (router_fakes)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from threaded_router import ThreadedRouter as _Router

SURROGATE = "\ud800"


@pytest.fixture(scope="module")
def router() -> Iterator[_Router]:
    r = _Router()
    r.start()
    yield r
    r.stop()


def _chat(**kw: Any) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **kw}


@pytest.mark.parametrize("path, body, param", [
    ("/v1/chat/completions", _chat(messages=[{"role": "user", "content": SURROGATE}]),
     "messages[0].content"),
    ("/v1/chat/completions", _chat(messages=[{"role": "user", "content": [
        {"type": "text", "text": "a" + SURROGATE}]}]), "messages[0].content[0].text"),
    ("/v1/chat/completions", _chat(messages=[{"role": SURROGATE, "content": "x"}]),
     "messages[0].role"),
    ("/v1/chat/completions", _chat(stop=SURROGATE), "stop"),
    ("/v1/chat/completions", _chat(stop=["ok", "\udfff"]), "stop[1]"),
    ("/v1/chat/completions", _chat(model=SURROGATE), "model"),
    ("/v1/chat/completions", _chat(user="\udc80"), "user"),
    ("/v1/chat/completions", {**_chat(), "x" + SURROGATE: 1}, "body"),
    ("/v1/completions", {"prompt": "caf\u00e9" + SURROGATE, "max_tokens": 4}, "prompt"),
    ("/v1/completions", {"prompt": ["x" + SURROGATE], "max_tokens": 4}, "prompt[0]"),
    ("/v1/completions", {"prompt": "a", "stop": [SURROGATE]}, "stop[0]"),
])
def test_a_lone_surrogate_is_a_400_naming_the_field(router: _Router, path: str, body: Any,
                                                   param: str) -> None:
    status, err = router.post(path, body)
    assert status == 400, err
    assert err["error"]["param"] == param
    assert err["error"]["message"].startswith(f"{param}: ")
    assert "surrogate" in err["error"]["message"]


def test_nul_is_ordinary_text(router: _Router) -> None:
    status, out = router.post("/v1/chat/completions", _chat(
        messages=[{"role": "user", "content": "a\x00b"}], stop=["\x00"]))
    assert status == 200, out
    status, out = router.post("/v1/completions", {"prompt": "\x00", "max_tokens": 2})
    assert status == 200, out


# Any JSON value, with strings drawn from every code point (surrogates and NUL included).
# (the odd ones also drawn on their own: among all code points they would be rare)
# (st.text() would leave surrogates out whatever its alphabet, hence lists joined)
_TEXT = st.lists(st.characters(codec=None, exclude_categories=())
                 | st.sampled_from(["\ud800", "\udfff", "\x00"]), max_size=12).map("".join)
_JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats() | _TEXT,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(_TEXT, inner, max_size=4),
    max_leaves=12)
_FIELDS = ["messages", "prompt", "model", "max_tokens", "max_completion_tokens", "stop",
           "temperature", "top_p", "seed", "logprobs", "top_logprobs", "stream_options",
           "stop_token_ids", "n", "user", "tools", "response_format", "tool_call_id"]
_MESSAGE = st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "system", "assistant", "developer"]),
     "content": _TEXT | st.lists(st.fixed_dictionaries({"type": st.just("text"),
                                                        "text": _TEXT}), max_size=3)},
    optional={"name": _TEXT})
_TOOL = st.fixed_dictionaries({"role": st.just("tool"), "content": _TEXT,
                               "tool_call_id": _TEXT})
# Mostly well-formed requests whose text is arbitrary (so the text reaches the encoders),
# some with one or two fields of any JSON value, and some bodies of anything at all.
_GOOD = st.fixed_dictionaries(
    {"messages": st.lists(_MESSAGE | _TOOL, min_size=1, max_size=3),
     "prompt": _TEXT.filter(bool), "max_tokens": st.integers(1, 4)},
    optional={"stop": _TEXT | st.lists(_TEXT, max_size=3), "model": _TEXT, "user": _TEXT})
_BODY = (_GOOD
         | st.tuples(_GOOD, st.dictionaries(st.sampled_from(_FIELDS) | _TEXT, _JSON,
                                            max_size=2)).map(lambda t: {**t[0], **t[1]})
         | _JSON)


@settings(max_examples=200, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(body=_BODY, chat=st.booleans())
def test_any_json_body_gets_an_answer_never_a_500(router: _Router, body: Any,
                                                  chat: bool) -> None:
    if isinstance(body, dict):  # a stream would answer 200 and carry any error as an event
        body.pop("stream", None)
    path = "/v1/chat/completions" if chat else "/v1/completions"
    status, out = router.post(path, body)
    assert status in (200, 400, 404), (status, out)
    if status == 400:
        param = out["error"]["param"]
        assert param and out["error"]["message"].startswith(f"{param}"), out


def test_a_large_body_is_checked_the_same(router: _Router) -> None:
    """Bodies past the off-loop bound are parsed in the tokenize pool: same 400."""
    filler = "x" * (300 << 10)
    status, err = router.post("/v1/chat/completions", _chat(messages=[
        {"role": "user", "content": filler}, {"role": "user", "content": SURROGATE}]))
    assert status == 400 and err["error"]["param"] == "messages[1].content", err
