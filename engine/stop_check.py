"""Stop conditions for one new output token, and how much text may be streamed so far.

Text that could still turn out to be the start of a stop string is held back, so a client
never receives characters that a later token reveals to be part of a stop string.
"""

from __future__ import annotations

from engine.request import Request
from engine.request_state import RequestState
from engine.stop_strings import find_stop, partial_stop_len


def check_stop(r: Request, i: int, tok: int, eos_ids: frozenset[int],
               max_model_len: int) -> tuple[RequestState | None, int | str | None, int | None]:
    """For r's output token i (already in r.full_text), returns (finished state or None,
    the stop token or string, the text length to cut r.full_text to, or None)."""
    p = r.params
    n_out = i + 1
    if n_out >= p.min_tokens:
        if tok in eos_ids and not p.ignore_eos:
            return RequestState.FINISHED_STOPPED, tok, None
        if tok in p.stop_token_ids:
            return RequestState.FINISHED_STOPPED, tok, None
        if p.stop:
            text = r.full_text
            at = find_stop(text, len(text) - r.text_checked, p.stop)
            if at is not None:
                s = next(s for s in p.stop if text.startswith(s, at))
                return RequestState.FINISHED_STOPPED, s, \
                    at + len(s) if p.include_stop_str_in_output else at
    if n_out >= p.max_tokens or r.num_prompt_tokens + n_out >= max_model_len:
        return RequestState.FINISHED_LENGTH, None, None
    return None, None, None


def streamable_len(r: Request) -> int:
    """How much of r.full_text can be sent while r runs: all but a possible stop prefix."""
    if not r.params.stop or r.params.include_stop_str_in_output:
        return len(r.full_text)
    hold = partial_stop_len(r.full_text, r.params.stop)
    return max(r.num_text_sent, len(r.full_text) - hold)
