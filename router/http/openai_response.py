"""The router's ``GenerateResponse`` stream -> OpenAI response objects and stream chunks
(chat.completion / chat.completion.chunk, text_completion), usage and logprobs included."""

from __future__ import annotations

import time
from typing import Any

from pdserve.v1 import common_pb2, router_pb2

from engine.tokenizer import Tokenizer
from router.http.openai_request import OpenAIRequest
from router.http.sse_template import TEXT_MARK, TextChunkTemplate
from router.http.tool_parse import parse_auto
from router.http.tool_stream import ToolStream

FINISH = {common_pb2.FINISH_REASON_STOP: "stop", common_pb2.FINISH_REASON_LENGTH: "length",
          common_pb2.FINISH_REASON_ABORT: "abort"}


class TokenTexts:
    """Each token id's own text, for logprobs (cached: the vocabulary bounds the cache)."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self._cache: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        text = self._cache.get(token_id)
        if text is None:
            text = self.tokenizer.decode([token_id], skip_special_tokens=False)
            self._cache[token_id] = text
        return text


class ResponseBuilder:
    """Accumulates one request's responses; builds chunks as they come and the final body."""

    def __init__(self, req: OpenAIRequest, model_id: str, texts: TokenTexts) -> None:
        self.req = req
        self.model = model_id
        self.texts = texts
        self.id = ""
        self.created = int(time.time())
        self.text: list[str] = []
        self.chat_logprobs: list[dict[str, Any]] = []
        self.cmpl_logprobs: dict[str, list[Any]] = {"tokens": [], "token_logprobs": [],
                                                    "top_logprobs": [], "text_offset": []}
        self._offset = 0  # completions text_offset: characters of the tokens so far
        self.finish: str | None = None
        self.error = ""  # the request failed in a worker (FINISH_REASON_ERROR)
        self.usage: dict[str, Any] | None = None
        # a chat with tools: calls are read from the text as it streams
        self.tools = ToolStream(req.tools) if req.chat and req.tools is not None else None
        # a stream's text-only chunks, encoded around the text (built at the first)
        self._text_chunk: TextChunkTemplate | None = None

    # -- accumulation ------------------------------------------------------------------------

    def start(self, resp: router_pb2.GenerateResponse) -> None:
        """Names the completion after the request (the first response carries its id)."""
        if not self.id:
            self.id = ("chatcmpl-" if self.req.chat else "cmpl-") + resp.request_id

    def add(self, resp: router_pb2.GenerateResponse) -> dict[str, Any] | None:
        """Takes one response; returns its stream chunk (None when there is nothing to send)."""
        self.start(resp)
        self.text.append(resp.text)
        new_lps = self._logprobs(resp) if self.req.logprobs is not None else None
        if resp.finish_reason:
            u = resp.usage
            self.usage = {"prompt_tokens": u.prompt_tokens,
                          "completion_tokens": u.completion_tokens,
                          "total_tokens": u.prompt_tokens + u.completion_tokens,
                          "prompt_tokens_details": {"cached_tokens": u.cached_tokens}}
            if resp.finish_reason == common_pb2.FINISH_REASON_ERROR:
                self.error = resp.error or "the request failed"
                return None
            self.finish = FINISH.get(resp.finish_reason, "stop")
        if self.tools is not None:
            return self._tool_chunk(resp.text, new_lps)
        if not resp.text and not resp.finish_reason and not new_lps:
            return None
        return self._chunk(resp.text, new_lps, self.finish)

    def text_sse(self, resp: router_pb2.GenerateResponse) -> bytes | None:
        """A response that only carries new text (no finish, no logprobs asked for, no tool
        parsing), taken as ``add`` takes it and returned as its SSE bytes: what ``sse`` of
        ``add``'s chunk gives, from the request's template. None for any other response,
        which then goes through ``add``."""
        if (resp.finish_reason or not resp.text or self.tools is not None
                or self.req.logprobs is not None):
            return None
        t = self._text_chunk
        if t is None:
            self.start(resp)
            t = self._text_chunk = TextChunkTemplate(self._chunk(TEXT_MARK, None, None))
        if not t.usable:
            return None
        self.text.append(resp.text)
        return t.render(resp.text)

    def _tool_chunk(self, text: str, lps: Any) -> dict[str, Any] | None:
        assert self.tools is not None
        content, calls = self.tools.feed(text)
        if self.finish is not None:
            rest, more = self.tools.finish()
            content, calls = content + rest, calls + more
            if self.tools.calls and self.finish == "stop":
                self.finish = "tool_calls"
        if not content and not calls and self.finish is None and not lps:
            return None
        return self._chunk(content, lps, self.finish, calls)

    def _logprobs(self, resp: router_pb2.GenerateResponse) -> Any:
        n = self.req.logprobs or 0
        if self.req.chat:
            entries = [self._chat_entry(lp, n) for lp in resp.logprobs]
            self.chat_logprobs += entries
            return entries
        out: dict[str, list[Any]] = {k: [] for k in self.cmpl_logprobs}
        for lp in resp.logprobs:
            tok = self.texts(lp.token_id)
            out["tokens"].append(tok)
            out["token_logprobs"].append(lp.logprob)
            out["top_logprobs"].append({self.texts(t.token_id): t.logprob for t in lp.top[:n]})
            out["text_offset"].append(self._offset)
            self._offset += len(tok)
        for k, v in out.items():
            self.cmpl_logprobs[k] += v
        return out if resp.logprobs else None

    def _chat_entry(self, lp: common_pb2.TokenLogprob, n: int) -> dict[str, Any]:
        tok = self.texts(lp.token_id)
        return {"token": tok, "logprob": lp.logprob, "bytes": list(tok.encode()),
                "top_logprobs": [{"token": (t := self.texts(x.token_id)), "logprob": x.logprob,
                                  "bytes": list(t.encode())} for x in lp.top[:n]]}

    # -- output ------------------------------------------------------------------------------

    def _chunk(self, text: str, lps: Any, finish: str | None,
               calls: list[dict[str, Any]] | None = None) -> dict[str, Any]:
        if self.req.chat:
            delta: dict[str, Any] = {"content": text} if text else {}
            if calls:
                delta["tool_calls"] = calls
            choice: dict[str, Any] = {"index": 0, "delta": delta,
                                      "logprobs": {"content": lps} if lps else None,
                                      "finish_reason": finish}
            obj = "chat.completion.chunk"
        else:
            choice = {"index": 0, "text": text, "logprobs": lps, "finish_reason": finish}
            obj = "text_completion"
        return self._envelope(obj, [choice], usage_null=self.req.include_usage)

    def role_chunk(self) -> dict[str, Any]:
        """Chat streams open with the assistant role, as OpenAI's do."""
        return self._envelope("chat.completion.chunk", [
            {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
             "finish_reason": None}], usage_null=self.req.include_usage)

    def usage_chunk(self) -> dict[str, Any]:
        obj = "chat.completion.chunk" if self.req.chat else "text_completion"
        out = self._envelope(obj, [])
        out["usage"] = self.usage
        return out

    def final(self) -> dict[str, Any]:
        text = "".join(self.text)
        if self.req.chat:
            message: dict[str, Any] = {"role": "assistant", "content": text}
            if self.tools is not None and self.tools.calls:
                content = parse_auto(text)[0] if self.tools.mode.mode == "auto" else ""
                message = {"role": "assistant", "content": content.strip() or None,
                           "tool_calls": [c.as_openai() for c in self.tools.calls]}
            choice: dict[str, Any] = {
                "index": 0, "message": message,
                "logprobs": {"content": self.chat_logprobs} if self.req.logprobs is not None
                else None, "finish_reason": self.finish}
            obj = "chat.completion"
        else:
            choice = {"index": 0, "text": text, "finish_reason": self.finish,
                      "logprobs": self.cmpl_logprobs if self.req.logprobs is not None else None}
            obj = "text_completion"
        out = self._envelope(obj, [choice])
        out["usage"] = self.usage
        return out

    def _envelope(self, obj: str, choices: list[dict[str, Any]],
                  usage_null: bool = False) -> dict[str, Any]:
        out: dict[str, Any] = {"id": self.id, "object": obj, "created": self.created,
                               "model": self.model, "choices": choices}
        if usage_null:  # OpenAI sends "usage": null on every chunk but the usage one
            out["usage"] = None
        return out
