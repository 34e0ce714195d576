"""SSE stream chunks as bytes, and a per-request template for the steady state's chunk.

Most chunks of a stream carry only new text: the same envelope (id, object, created,
model, the choice's other fields) around a different string. ``TextChunkTemplate`` encodes
that envelope once per request, split around the text, so each such chunk costs one C-level
string encode and two concatenations instead of building and encoding a nested dict:
byte for byte what ``sse`` of the full chunk gives.
"""

from __future__ import annotations

import json
from json.encoder import encode_basestring_ascii  # type: ignore[attr-defined]
from typing import Any

# Stands for the text while the envelope is encoded; private-use code points, so a model's
# text or a request id containing it is unlikely, and the template checks it found one.
TEXT_MARK = "\ue000pdserve-text\ue001"


def sse(obj: Any) -> bytes:
    """One server-sent event carrying ``obj`` as compact JSON."""
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


class TextChunkTemplate:
    def __init__(self, chunk: dict[str, Any]) -> None:
        """chunk: the request's text chunk with ``TEXT_MARK`` as its text."""
        parts = sse(chunk).split(encode_basestring_ascii(TEXT_MARK).encode())
        # the mark must be the text's alone (a request id could carry it too)
        self.usable = len(parts) == 2
        self._head, self._tail = (parts[0], parts[1]) if self.usable else (b"", b"")

    def render(self, text: str) -> bytes:
        """The chunk with ``text``, as ``sse`` encodes it (json.dumps' default
        ``ensure_ascii`` string encoding)."""
        return self._head + encode_basestring_ascii(text).encode() + self._tail
