"""The steady state's pre-encoded text chunk is byte for byte the chunk ``add`` builds and
``sse`` encodes, for chat and completions, with and without the usage field, for texts
that need JSON escaping; an envelope carrying the template's mark as a whole string falls
back."""

from __future__ import annotations

from pdserve.v1 import router_pb2

from router.http.openai_request import parse_chat, parse_completion
from router.http.openai_response import ResponseBuilder
from router.http.sse_template import TEXT_MARK, sse

TEXTS = ["Hello", " wörld", 'quote " and \\ back', "tab\tnew\nline", "\u2028emoji \U0001f600",
         "\x00\x1f", TEXT_MARK]


def builders() -> list[tuple[ResponseBuilder, ResponseBuilder]]:
    reqs = [parse_chat({"messages": [{"role": "user", "content": "hi"}], "stream": True}),
            parse_chat({"messages": [{"role": "user", "content": "hi"}], "stream": True,
                        "stream_options": {"include_usage": True}}),
            parse_completion({"prompt": "x", "stream": True}),
            parse_completion({"prompt": "x", "stream": True,
                              "stream_options": {"include_usage": True}})]
    out = []
    for req in reqs:
        pair = (ResponseBuilder(req, "m", None), ResponseBuilder(req, "m", None))  # type: ignore[arg-type]
        pair[1].created = pair[0].created
        out.append(pair)
    return out


def test_template_chunks_equal_the_built_ones() -> None:
    for rid in ("r-1", "weird \"id\" \u00e9"):
        for fast, slow in builders():
            for text in TEXTS:
                resp = router_pb2.GenerateResponse(request_id=rid, token_ids=[5], text=text)
                data = fast.text_sse(resp)
                chunk = slow.add(resp)
                assert chunk is not None and data == sse(chunk), (text, data, sse(chunk))
            assert fast.text == slow.text == TEXTS


def test_other_responses_go_through_add() -> None:
    fast, _ = builders()[0]
    end = router_pb2.GenerateResponse(request_id="r", token_ids=[5], text="x", finish_reason=1)
    assert fast.text_sse(end) is None
    assert fast.text_sse(router_pb2.GenerateResponse(request_id="r", token_ids=[5])) is None
    assert fast.text == []
    lp_req = parse_completion({"prompt": "x", "stream": True, "logprobs": 1})
    lp = ResponseBuilder(lp_req, "m", None)  # type: ignore[arg-type]
    assert lp.text_sse(router_pb2.GenerateResponse(request_id="r", text="x")) is None


def test_the_mark_elsewhere_in_the_envelope() -> None:
    """Inside a longer string (the id) the quoted mark cannot match; as a whole string
    elsewhere (a model named so) it does, and the template steps aside for ``add``."""
    fast, slow = builders()[2]
    resp = router_pb2.GenerateResponse(request_id=TEXT_MARK, token_ids=[5], text="x")
    chunk = slow.add(resp)
    assert chunk is not None and fast.text_sse(resp) == sse(chunk)
    req = parse_completion({"prompt": "x", "stream": True})
    odd = ResponseBuilder(req, TEXT_MARK, None)  # type: ignore[arg-type]
    resp = router_pb2.GenerateResponse(request_id="r", token_ids=[5], text="x")
    assert odd.text_sse(resp) is None
    assert odd.text == []  # nothing taken: add takes it
    chunk = odd.add(resp)
    assert chunk is not None and chunk["choices"][0]["text"] == "x"
