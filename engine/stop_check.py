"""Stop conditions for one new output token, and how much text may be streamed so far.

Text that could still turn out to be the start of a stop string is held back, so a client
never receives characters that a later token reveals to be part of a stop string.
"""

from __future__ import annotations

from engine.request import Request
from engine.request_state import RequestState


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
            hit = _find_stop(r.full_text, r.text_checked, p.stop)
            if hit is not None:
                at, s = hit
                return RequestState.FINISHED_STOPPED, s, \
                    at + len(s) if p.include_stop_str_in_output else at
    if n_out >= p.max_tokens or r.num_prompt_tokens + n_out >= max_model_len:
        return RequestState.FINISHED_LENGTH, None, None
    return None, None, None


def _find_stop(text: str, checked: int, stops: list[str]) -> tuple[int, str] | None:
    """Earliest stop string in text that ends after `checked` (earlier text was searched)."""
    best: tuple[int, str] | None = None
    for s in stops:
        at = text.find(s, max(0, checked - len(s) + 1))
        if at >= 0 and (best is None or at < best[0]):
            best = (at, s)
    return best


def streamable_len(r: Request) -> int:
    """How much of r.full_text can be sent while r runs: all but a possible stop prefix."""
    if not r.params.stop or r.params.include_stop_str_in_output:
        return len(r.full_text)
    hold = max(len(s) for s in r.params.stop) - 1
    return max(r.num_text_sent, len(r.full_text) - hold)
