"""Tool calls read back from a model's text.

Formats: Hermes / Qwen (``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, any
number, after optional text) and Llama 3 JSON (the whole reply is ``{"name": ...,
"parameters": {...}}``, optionally after ``<|python_tag|>``, several joined by ``;``). A
reply in neither format, or whose JSON does not parse, is plain content. Forced choices
(router.http.structured_request) have their own shapes: a named function's reply is its
arguments, ``required``'s is a JSON array of ``{"name", "arguments"}``.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from router.http.structured_request import ToolMode

HERMES_OPEN = "<tool_call>"
_HERMES = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.S)
PYTHON_TAG = "<|python_tag|>"


@dataclass
class ToolCall:
    name: str
    arguments: str  # JSON text, as OpenAI sends it
    id: str = field(default_factory=lambda: "call_" + uuid.uuid4().hex[:24])

    def as_openai(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


def parse(text: str, mode: ToolMode) -> tuple[str, list[ToolCall]]:
    """(the text before any call, the calls); no calls: (text, [])."""
    if mode.mode == "named":
        return "", [ToolCall(mode.name, text.strip())]
    if mode.mode == "required":
        calls = _required(text)
        return ("", calls) if calls else (text, [])
    return parse_auto(text)


def parse_auto(text: str) -> tuple[str, list[ToolCall]]:
    at = text.find(HERMES_OPEN)
    if at >= 0:
        calls = []
        for m in _HERMES.finditer(text, at):
            call = _call(_json(m.group(1)))
            if call is None:
                return text, []
            calls.append(call)
        return text[:at], calls
    body = text.strip()
    if body.startswith(PYTHON_TAG):
        body = body[len(PYTHON_TAG):].strip()
    if body.startswith(("{", "[")):
        calls = _llama(body)
        if calls:
            return "", calls
    return text, []


def _required(text: str) -> list[ToolCall]:
    v = _json(text)
    if not isinstance(v, list):
        return []
    calls = [_call(x) for x in v]
    return [c for c in calls if c is not None] if all(calls) else []


def _llama(body: str) -> list[ToolCall]:
    """One JSON object, a JSON list of them, or objects joined by ';'."""
    whole = _json(body)
    items = whole if isinstance(whole, list) else [whole] if whole is not None else None
    if items is None:
        items = []
        dec = json.JSONDecoder()
        i = 0
        while i < len(body):
            try:
                v, i = dec.raw_decode(body, i)
            except json.JSONDecodeError:
                return []
            items.append(v)
            while i < len(body) and body[i] in "; \n\t":
                i += 1
    calls = [_call(x) for x in items]
    return [c for c in calls if c is not None] if calls and all(calls) else []


def _call(v: Any) -> ToolCall | None:
    if not isinstance(v, dict) or not isinstance(v.get("name"), str):
        return None
    args = v.get("arguments", v.get("parameters", {}))
    if isinstance(args, str):  # some models send the JSON text itself
        return ToolCall(v["name"], args)
    return ToolCall(v["name"], json.dumps(args, ensure_ascii=False))


def _json(s: str) -> Any:
    try:
        return json.loads(s)
    except json.JSONDecodeError:
        return None
