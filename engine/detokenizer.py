"""Streaming detokenization: text deltas per generated token, never broken UTF-8.

Torch-free (the router streams text too). Decoding each step only a short window of
recent tokens keeps the cost per token constant. The window starts a few tokens *behind*
what was already emitted (the "prefix"), because a decoder's output for a token can
depend on its neighbours: SentencePiece drops the leading space of a window's first
token, and a byte-level token may end in the middle of a UTF-8 character. We decode
both ``ids[prefix:read]`` and ``ids[prefix:]`` and emit only the difference.

A window whose text ends in U+FFFD is usually a character whose bytes are split across
tokens; we emit the text before it and hold the rest until a later token completes the
character. ``flush()`` releases whatever is still held when the sequence ends (it is
only non-empty if the model really produced invalid or unterminated UTF-8).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

_REPLACEMENT = "\ufffd"
# Prompt tokens decoded as left context for the first output token: enough for a decoder
# to see whether the first output token starts a word.
_PROMPT_CONTEXT = 5


class _Decoder(Protocol):
    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...


class IncrementalDetokenizer:
    """Feed output token ids one at a time; each ``add`` returns the new text (maybe "")."""

    def __init__(self, tokenizer: _Decoder, prompt_ids: Sequence[int] | None = None,
                 skip_special_tokens: bool = True) -> None:
        self._tok = tokenizer
        self._skip = skip_special_tokens
        self._ids: list[int] = list(prompt_ids[-_PROMPT_CONTEXT:]) if prompt_ids else []
        self._prefix = 0  # window start: context tokens, already emitted or prompt
        self._read = len(self._ids)  # tokens before this are fully emitted
        self._prefix_len = len(self._decode(self._prefix, self._read))  # chars of the context
        self._held_emitted = 0  # chars past the context already emitted from a pending window
        self._chunks: list[str] = []
        self._text: str | None = ""  # cached join of _chunks

    def _decode(self, start: int, end: int | None = None) -> str:
        return self._tok.decode(self._ids[start:end], skip_special_tokens=self._skip)

    def _emit(self, delta: str) -> str:
        if delta:
            self._chunks.append(delta)
            self._text = None
        return delta

    def add(self, token_id: int) -> str:
        """Append one token; return the text it completes (possibly empty)."""
        self._ids.append(token_id)
        window = self._decode(self._prefix)
        done = self._prefix_len + self._held_emitted
        if window.endswith(_REPLACEMENT):
            # Characters before the trailing U+FFFD run are complete and cannot change.
            stable = window.rstrip(_REPLACEMENT)
            delta = stable[done:]
            self._held_emitted += len(delta)
            return self._emit(delta)
        delta = window[done:]
        # Slide: the tokens just emitted become the next window's left context.
        self._prefix, self._read = self._read, len(self._ids)
        self._prefix_len = len(self._decode(self._prefix, self._read))
        self._held_emitted = 0
        # Keep only the live window; ids before it are never decoded again.
        if self._prefix > 0:
            del self._ids[: self._prefix]
            self._read -= self._prefix
            self._prefix = 0
        return self._emit(delta)

    def flush(self) -> str:
        """At the end of a sequence: whatever is held back (replacement chars included)."""
        window = self._decode(self._prefix)
        delta = window[self._prefix_len + self._held_emitted:]
        self._prefix = self._read = len(self._ids)
        self._prefix_len = self._held_emitted = 0
        return self._emit(delta)

    @property
    def text(self) -> str:
        """All text emitted so far (the concatenation of every delta)."""
        if self._text is None:
            self._text = "".join(self._chunks)
            self._chunks = [self._text]
        return self._text

    @property
    def pending_tokens(self) -> int:
        """Tokens whose text is (partly) held back waiting for more bytes."""
        return len(self._ids) - self._read
