"""Streams a reply that may hold tool calls: text that cannot be part of a call goes out as
content at once; text that may be (from ``<tool_call>``, or a reply that opens with JSON in
``auto`` mode, or any reply of ``required``) is held and read when the reply ends. A named
function's arguments stream as they come, as OpenAI streams them.
"""

from __future__ import annotations

from typing import Any

from router.http.structured_request import ToolMode
from router.http.tool_parse import HERMES_OPEN, PYTHON_TAG, ToolCall, parse


class ToolStream:
    def __init__(self, mode: ToolMode) -> None:
        self.mode = mode
        self.text = ""
        self.sent = 0  # text[:sent] went out as content (or as a named call's arguments)
        self.calls: list[ToolCall] = []
        self._named: ToolCall | None = None

    def feed(self, piece: str) -> tuple[str, list[dict[str, Any]]]:
        """(content to send now, tool-call deltas to send now) for the next piece of text."""
        self.text += piece
        if self.mode.mode == "named":
            return "", self._named_delta()
        if self.mode.mode == "required":
            return "", []
        return self._content_now(), []

    def finish(self) -> tuple[str, list[dict[str, Any]]]:
        """What is left to send once the reply has ended; ``calls`` then holds every call."""
        if self.mode.mode == "named":
            deltas = self._named_delta()
            assert self._named is not None
            self._named.arguments = self._named.arguments.strip()
            self.calls = [self._named]
            return "", deltas
        content, calls = parse(self.text, self.mode)
        self.calls = calls
        if not calls:
            rest, self.sent = self.text[self.sent:], len(self.text)
            return rest, []
        rest = content[self.sent:]
        return rest, [{"index": i, **c.as_openai()} for i, c in enumerate(calls)]

    def _content_now(self) -> str:
        head = self.text.lstrip()
        if not head or head.startswith(("{", "[", PYTHON_TAG)) \
                or PYTHON_TAG.startswith(head):
            return ""  # may be a Llama 3 JSON call: decided when the reply ends
        at = self.text.find(HERMES_OPEN)
        end = at if at >= 0 else len(self.text) - _partial_open(self.text)
        if end <= self.sent:
            return ""
        out, self.sent = self.text[self.sent:end], end
        return out

    def _named_delta(self) -> list[dict[str, Any]]:
        new = self.text[self.sent:]
        self.sent = len(self.text)
        if self._named is None:
            self._named = ToolCall(self.mode.name, new)
            return [{"index": 0, **self._named.as_openai()}]
        if not new:
            return []
        self._named.arguments += new
        return [{"index": 0, "function": {"arguments": new}}]


def _partial_open(text: str) -> int:
    """How many trailing characters could be the start of ``<tool_call>``."""
    for n in range(min(len(HERMES_OPEN) - 1, len(text)), 0, -1):
        if HERMES_OPEN.startswith(text[-n:]):
            return n
    return 0
