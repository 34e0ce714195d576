"""An OpenAI request body (chat or completions) -> the router's ``GenerateRequest``.

Only the shape and the OpenAI-specific rules are checked here (types, ranges the proto
cannot hold, n=1, unsupported features); everything the gRPC API also checks is left to
``router.requests.validation`` so both doors refuse the same things with the same words.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Any

from pdserve.v1 import common_pb2, router_pb2

from engine.sampling_fields import MAX_LOGPROBS, MAX_STOP
from router.config import RouterConfig
from router.http.http_errors import bad_field

log = logging.getLogger("pdserve.router.http")

U32 = (1 << 32) - 1
DEFAULT_MAX_TOKENS_LIMIT = RouterConfig.max_tokens_limit
COMPLETION_MAX_LOGPROBS = 5  # the completions API's own limit
# Non-OpenAI sampling fields accepted as extensions (same names as vLLM's), with the proto
# field each sets and its type: "int", "u32", "num" or "bool".
_EXTRAS = {"top_k": "int", "min_p": "num", "repetition_penalty": "num", "min_tokens": "u32",
           "ignore_eos": "bool", "skip_special_tokens": "bool",
           "include_stop_str_in_output": "bool"}


@dataclass
class OpenAIRequest:
    chat: bool  # /v1/chat/completions (else /v1/completions)
    generate: router_pb2.GenerateRequest
    model: str | None  # as the client named it (None: not given)
    stream: bool
    include_usage: bool  # stream_options.include_usage: a last chunk with usage
    logprobs: int | None  # alternatives per token (chat: top_logprobs) when requested


class _Body:
    """Typed reads of one JSON object; every failure is a 400 naming the field."""

    def __init__(self, body: Any, known: frozenset[str]) -> None:
        if not isinstance(body, dict):
            raise bad_field("body", "must be a JSON object")
        check_text(body)
        _note_unknown(body, known)
        self.d = body

    def get(self, name: str) -> Any:
        return self.d.get(name)

    def bool(self, name: str) -> bool | None:
        v = self.d.get(name)
        if v is not None and not isinstance(v, bool):
            raise bad_field(name, "must be a boolean")
        return v

    def int(self, name: str, lo: int, hi: int) -> int | None:
        v = self.d.get(name)
        if v is None:
            return None
        if isinstance(v, float) and v.is_integer():
            v = int(v)  # 16.0 from a JavaScript client
        if not isinstance(v, int) or isinstance(v, bool):
            raise bad_field(name, f"must be an integer, got {_show(v)}")
        if not lo <= v <= hi:
            raise bad_field(name, f"must be in [{lo}, {hi}], got {v}")
        return v

    def num(self, name: str, lo: float, hi: float) -> float | None:
        v = self.d.get(name)
        if v is None:
            return None
        if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v):
            raise bad_field(name, f"must be a finite number, got {_show(v)}")
        if not lo <= v <= hi:
            raise bad_field(name, f"must be in [{lo:g}, {hi:g}], got {v:g}")
        return float(v)


def _show(v: Any) -> str:
    s = repr(v)
    return s if len(s) <= 40 else s[:37] + "..."


def parse_chat(body: Any, max_tokens_limit: int = DEFAULT_MAX_TOKENS_LIMIT) -> OpenAIRequest:
    b = _Body(body, CHAT_FIELDS)
    msgs = b.get("messages")
    if not isinstance(msgs, list):
        raise bad_field("messages", "must be a list of messages")
    chat = router_pb2.ChatMessages()
    for i, m in enumerate(msgs):
        chat.messages.append(_message(m, f"messages[{i}]"))
    logprobs = b.bool("logprobs")
    top = b.int("top_logprobs", 0, MAX_LOGPROBS)
    if top is not None and not logprobs:
        raise bad_field("top_logprobs", "requires logprobs: true")
    for name in ("tools", "functions"):
        if b.get(name):
            raise bad_field(name, "tool and function calling are not supported")
    fmt = b.get("response_format")
    if fmt is not None and (not isinstance(fmt, dict) or fmt.get("type") != "text"):
        raise bad_field("response_format", "only {\"type\": \"text\"} is supported")
    sampling = _sampling(b, max_tokens_limit)
    max_completion = b.int("max_completion_tokens", 1, max_tokens_limit)
    if max_completion is not None:  # the newer name wins over the deprecated max_tokens
        sampling.max_tokens = max_completion
    if logprobs:
        sampling.logprobs = top or 0
    return _request(b, router_pb2.GenerateRequest(chat=chat, sampling=sampling), True,
                    (top or 0) if logprobs else None)


def parse_completion(body: Any,
                     max_tokens_limit: int = DEFAULT_MAX_TOKENS_LIMIT) -> OpenAIRequest:
    b = _Body(body, COMPLETION_FIELDS)
    gen = router_pb2.GenerateRequest()
    _prompt(b.get("prompt"), gen)
    if b.bool("echo"):
        raise bad_field("echo", "echo is not supported")
    if b.get("suffix") is not None:
        raise bad_field("suffix", "suffix (insertion) is not supported")
    if b.int("best_of", 1, U32) not in (None, 1):
        raise bad_field("best_of", "only best_of=1 is supported")
    logprobs = b.int("logprobs", 0, COMPLETION_MAX_LOGPROBS)
    sampling = _sampling(b, max_tokens_limit)
    if logprobs is not None:
        sampling.logprobs = logprobs
    gen.sampling.CopyFrom(sampling)
    return _request(b, gen, False, logprobs)


def _request(b: _Body, gen: router_pb2.GenerateRequest, chat: bool,
             logprobs: int | None) -> OpenAIRequest:
    model = b.get("model")
    if model is not None and not isinstance(model, str):
        raise bad_field("model", "must be a string")
    n = b.int("n", 1, U32)
    if n not in (None, 1):
        raise bad_field("n", f"only n=1 is supported, got {n}")
    if b.get("logit_bias"):
        raise bad_field("logit_bias", "logit_bias is not supported")
    stream = bool(b.bool("stream"))
    opts = b.get("stream_options")
    include_usage = False
    if opts is not None:
        if not isinstance(opts, dict):
            raise bad_field("stream_options", "must be an object")
        usage = opts.get("include_usage")
        if usage is not None and not isinstance(usage, bool):
            raise bad_field("stream_options.include_usage", "must be a boolean")
        include_usage = bool(usage)
    if model:
        gen.model = model
    return OpenAIRequest(chat=chat, generate=gen, model=model or None, stream=stream,
                         include_usage=include_usage, logprobs=logprobs)


def _sampling(b: _Body, max_tokens_limit: int) -> common_pb2.SamplingParams:
    s = common_pb2.SamplingParams()
    # The router's own limit (--max-tokens-limit), so a -1 and a 10**7 get the same words
    # as the gRPC door gives (router/requests/validation.py).
    max_tokens = b.int("max_tokens", 1, max_tokens_limit)
    if max_tokens is not None:
        s.max_tokens = max_tokens
    for name, lo, hi in (("temperature", 0.0, 2.0), ("top_p", 0.0, 1.0)):
        x = b.num(name, lo, hi)
        if x is not None:
            setattr(s, name, x)
    for name in ("presence_penalty", "frequency_penalty"):
        pen = b.num(name, -2.0, 2.0)
        if pen is not None:
            setattr(s, name, pen)
    seed = b.int("seed", 0, (1 << 63) - 1)
    if seed is not None:
        s.seed = seed
    stop = b.get("stop")
    if isinstance(stop, str):
        stop = [stop]
    if stop is not None:
        if not isinstance(stop, list) or not all(isinstance(x, str) for x in stop):
            raise bad_field("stop", "must be a string or a list of strings")
        if len(stop) > MAX_STOP:
            raise bad_field("stop", f"at most {MAX_STOP} stop strings")
        s.stop.extend(stop)
    for name, kind in _EXTRAS.items():
        if kind == "bool":
            v: Any = b.bool(name)
        elif kind == "num":
            v = b.num(name, -1e6, 1e6)  # float32-safe; the engine checks the real range
        else:
            v = b.int(name, -1 if kind == "int" else 0, (1 << 31) - 1 if kind == "int" else U32)
        if v is not None:
            setattr(s, name, v)
    ids = b.get("stop_token_ids")
    if ids is not None:
        if not isinstance(ids, list) or not all(
                isinstance(t, int) and not isinstance(t, bool) and 0 <= t <= U32 for t in ids):
            raise bad_field("stop_token_ids", "must be a list of non-negative integers")
        s.stop_token_ids.extend(ids)
    return s


def _message(m: Any, where: str) -> router_pb2.ChatMessage:
    if not isinstance(m, dict):
        raise bad_field(where, "must be an object with role and content")
    role = m.get("role")
    if not isinstance(role, str):
        raise bad_field(f"{where}.role", "must be a string")
    if role == "developer":  # OpenAI's newer name for the system role
        role = "system"
    if role == "tool":
        # A tool's result answers the assistant's call of that id (OpenAI's spec requires
        # it); the chat template renders the message by its role and content.
        call_id = m.get("tool_call_id")
        if not isinstance(call_id, str) or not call_id:
            raise bad_field(f"{where}.tool_call_id",
                            "a tool message needs the id of the call it answers")
    content = m.get("content")
    if content is None:
        text = ""
    elif isinstance(content, str):
        text = content
    elif isinstance(content, list):
        parts = []
        for j, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text" \
                    or not isinstance(part.get("text"), str):
                raise bad_field(f"{where}.content[{j}]",
                                "only {\"type\": \"text\", \"text\": ...} parts are supported")
            parts.append(part["text"])
        text = "\n".join(parts)
    else:
        raise bad_field(f"{where}.content", "must be a string or a list of text parts")
    return router_pb2.ChatMessage(role=role, content=text)


def _prompt(p: Any, gen: router_pb2.GenerateRequest) -> None:
    if isinstance(p, list) and len(p) == 1 and isinstance(p[0], (str, list)):
        p = p[0]  # a batch of one
    elif isinstance(p, list) and p and isinstance(p[0], (str, list)):
        raise bad_field("prompt", "one prompt per request (batches are not supported)")
    if isinstance(p, str):
        gen.prompt = p
        if not p:
            raise bad_field("prompt", "must not be empty")
        return
    if isinstance(p, list) and p and all(
            isinstance(t, int) and not isinstance(t, bool) and 0 <= t <= U32 for t in p):
        gen.prompt_token_ids.ids.extend(p)
        return
    raise bad_field("prompt", "must be a non-empty string, or a non-empty list of token ids")


# The body fields each endpoint reads. ``user`` is OpenAI's end-user tag: accepted and not
# used. docs/http_api.md lists these; keep the two in step.
_COMMON_FIELDS = frozenset({
    "model", "max_tokens", "temperature", "top_p", "presence_penalty", "frequency_penalty",
    "seed", "stop", "n", "logit_bias", "stream", "stream_options", "stop_token_ids", "user",
    *_EXTRAS})
CHAT_FIELDS = _COMMON_FIELDS | {"messages", "max_completion_tokens", "logprobs",
                                "top_logprobs", "tools", "functions", "response_format"}
COMPLETION_FIELDS = _COMMON_FIELDS | {"prompt", "echo", "suffix", "best_of", "logprobs"}
# Field names already logged as unknown, bounded: the names come from clients.
_UNKNOWN_SEEN: set[str] = set()
MAX_UNKNOWN_LOGGED = 256


def _note_unknown(body: dict[str, Any], known: frozenset[str]) -> None:
    """Logs each unknown field's name the first time any request carries it: the request
    is served as if it were absent (as OpenAI-compatible servers do), but an operator can
    see what clients expected to happen."""
    for name in body:
        if name in known or name in _UNKNOWN_SEEN or len(_UNKNOWN_SEEN) >= MAX_UNKNOWN_LOGGED:
            continue
        _UNKNOWN_SEEN.add(name)
        log.warning("ignoring the unknown request field %s (logged once per field; the "
                    "supported ones are listed in docs/http_api.md)", ascii(name))
        if len(_UNKNOWN_SEEN) == MAX_UNKNOWN_LOGGED:
            log.warning("%d unknown request fields logged; no more will be",
                        MAX_UNKNOWN_LOGGED)


def check_text(body: Any) -> None:
    """Refuses a body with a lone surrogate in any string (keys included), naming where.

    Such a string is valid JSON (``"\\ud800"``) but not Unicode text: it cannot be encoded
    to UTF-8, so it would fail deep inside protobuf or the tokenizer as a 500. NUL and every
    other code point are text and pass."""
    stack: list[tuple[str, Any]] = [("", body)]
    while stack:
        path, v = stack.pop()
        if isinstance(v, str):
            if _bad_text(v):
                raise bad_field(path or "body",
                                "contains a lone UTF-16 surrogate (not valid Unicode text)")
        elif isinstance(v, dict):
            for k, x in v.items():
                if _bad_text(k):
                    raise bad_field(path or "body", "a field name contains a lone UTF-16 "
                                                    "surrogate (not valid Unicode text)")
                if isinstance(x, (str, dict, list)):
                    stack.append((f"{path}.{k}" if path else k, x))
        elif isinstance(v, list):
            # token-id lists can be long: only strings and containers need a path
            stack.extend((f"{path}[{i}]", x) for i, x in enumerate(v)
                         if isinstance(x, (str, dict, list)))


def _bad_text(s: str) -> bool:
    # isascii() is O(1) in CPython (the string's kind says it), so ASCII text costs nothing;
    # other text pays one UTF-8 encode (~2.5 ms per MB, faster than a regex scan).
    if s.isascii():
        return False
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False
