"""The requests a benchmark sends: prompts as token ids (exact lengths) and output lengths.

Lengths are fixed (``"256"``) or uniform in an inclusive range (``"128:512"``), or taken
from a ShareGPT-format JSON file (first human turn = prompt, first gpt turn = the output
length). Everything is drawn from one seeded generator, so the same flags give the same
workload for every configuration of a comparison.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class RequestSpec:
    prompt_ids: tuple[int, ...]  # sent as prompt_token_ids, so the length is exact
    output_len: int  # max_tokens (exact with --ignore-eos)
    # A replayed trace's arrival (seconds from the start; None: the load point decides)
    at_s: float | None = None
    # Prompt tokens an infinite prefix cache would hold when this request arrives, had every
    # earlier request of the workload been served (the workload's ideal hit)
    ideal_cached: int = 0

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_ids)


@dataclass(frozen=True)
class LengthRange:
    low: int
    high: int  # inclusive

    @staticmethod
    def parse(flag: str, text: str) -> LengthRange:
        lo, sep, hi = text.partition(":")
        try:
            r = LengthRange(int(lo), int(hi) if sep else int(lo))
        except ValueError:
            raise ValueError(f"{flag}: expected N or LOW:HIGH, got {text!r}") from None
        if r.low < 1 or r.high < r.low:
            raise ValueError(f"{flag}: need 1 <= LOW <= HIGH, got {text!r}")
        return r

    def draw(self, rng: random.Random) -> int:
        return self.low if self.low == self.high else rng.randint(self.low, self.high)


def random_workload(n: int, input_len: LengthRange, output_len: LengthRange,
                    token_range: LengthRange, seed: int) -> list[RequestSpec]:
    """``n`` prompts of random token ids in ``token_range`` (chosen away from special ids)."""
    rng = random.Random(seed)
    specs = []
    for _ in range(n):
        plen = input_len.draw(rng)
        ids = tuple(rng.randint(token_range.low, token_range.high) for _ in range(plen))
        specs.append(RequestSpec(ids, output_len.draw(rng)))
    return specs


def _turns(item: Any) -> tuple[str, str] | None:
    conv = item.get("conversations") if isinstance(item, dict) else None
    if not isinstance(conv, list) or len(conv) < 2:
        return None
    first, second = conv[0], conv[1]
    if not (isinstance(first, dict) and isinstance(second, dict)):
        return None
    p, c = first.get("value"), second.get("value")
    return (p, c) if isinstance(p, str) and isinstance(c, str) else None


def sharegpt_workload(path: str, n: int, encode: Any, seed: int, max_len: int,
                      output_len: LengthRange | None = None) -> list[RequestSpec]:
    """``n`` conversations drawn (seeded) from a ShareGPT JSON list.

    ``encode(text) -> list[int]`` is the served model's tokenizer. Like vLLM, pairs whose
    prompt or completion is under 4 tokens are skipped, and so are pairs longer than
    ``max_len`` in all; ``output_len`` overrides the completion's length when given.
    """
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    if not isinstance(data, list):
        raise ValueError(f"--dataset: {path} is not a JSON list of conversations")
    rng = random.Random(seed)
    order = list(range(len(data)))
    rng.shuffle(order)
    specs: list[RequestSpec] = []
    for i in order:
        if len(specs) == n:
            break
        turns = _turns(data[i])
        if turns is None:
            continue
        prompt = encode(turns[0])
        out = output_len.draw(rng) if output_len else len(encode(turns[1]))
        if len(prompt) < 4 or out < 4 or len(prompt) + out > max_len:
            continue
        specs.append(RequestSpec(tuple(prompt), out))
    if len(specs) < n:
        raise ValueError(f"--dataset: {path} has only {len(specs)} usable conversations "
                         f"(asked for {n})")
    return specs
