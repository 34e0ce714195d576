"""One request's grammar state: an llguidance matcher and how many output tokens it has
taken. It is rebuilt from the tokens alone, so a consumer resumes a producer's request (token
0 arrives with the KV) and a migrated request resumes (its prior outputs arrive with the
prompt) by feeding those tokens to a fresh matcher: no matcher state crosses nodes.

Torch-free.
"""

from __future__ import annotations

from typing import Any


class RequestGrammar:
    def __init__(self, matcher: Any) -> None:
        self.matcher = matcher  # llguidance.LLMatcher
        self.num_accepted = 0  # output tokens the matcher has consumed

    def accept(self, token_id: int) -> bool:
        """Advances by one output token; False (and an error state) when the grammar does
        not allow it, or the matcher had already failed."""
        self.num_accepted += 1
        if self.matcher.is_error():
            return False
        return bool(self.matcher.consume_token(token_id))

    @property
    def failed(self) -> bool:
        return bool(self.matcher.is_error())

    def error(self) -> str:
        return str(self.matcher.get_error()) if self.failed else ""
