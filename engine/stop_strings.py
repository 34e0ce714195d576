"""Stop-string search over streamed text, touching only what a new delta could complete.

Torch-free: the engine checks stops after each detokenized delta, and the router uses
the same helpers to hold back text that may still become a stop string.
"""

from __future__ import annotations

from collections.abc import Sequence


def find_stop(text: str, new_delta_len: int, stop_strings: Sequence[str]) -> int | None:
    """Index in ``text`` where the earliest stop string begins, among those ending inside
    the last ``new_delta_len`` characters; None if there is none.

    Text before the delta was searched on earlier calls, so a match must end in the delta;
    it can start up to ``len(stop) - 1`` characters before it.
    """
    if new_delta_len <= 0:
        return None
    best: int | None = None
    tail_start = len(text) - new_delta_len
    for stop in stop_strings:
        if not stop:
            continue
        at = text.find(stop, max(0, tail_start - len(stop) + 1))
        if at >= 0 and (best is None or at < best):
            best = at
    return best


def partial_stop_len(text: str, stop_strings: Sequence[str]) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of a stop string:
    that many trailing characters must be held back from a client until more text arrives."""
    held = 0
    for stop in stop_strings:
        for n in range(min(len(stop) - 1, len(text)), held, -1):
            if text.endswith(stop[:n]):
                held = n
                break
    return held
