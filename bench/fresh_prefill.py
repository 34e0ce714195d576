"""Prefills the prefix cache cannot shortcut, for benches that time them.

A bench that times the same prompts more than once in one process (moe_bench.py's
--prefill-variants calls moe_bench.prefill_point once a round) finds them in the prefix
cache from the second time on wherever the pool still holds their blocks: its "prefill" then
computes only the last partial block. Session 48's Mixtral A/B at 1,024 tokens timed exactly
that (8 layers, a 265-block pool: three 64-block prompts fit): ~8.7 ms a round after the
first, the time of reading every expert's weights for 16 tokens, against ~15.6 ms for the
real prefill (bench/RESULTS.md, "Mixtral's 1,024-token prefill was a cache hit"). Here each
prompt's first token is one no earlier prompt of this process had, so no block of it can hit
(a block's hash chains through its predecessors), and a run that still reports cached tokens
is refused rather than timed.
"""

from __future__ import annotations

import itertools
from typing import Any

# prompt first tokens, from 1 up: small enough for every vocabulary the benches use
_FIRST_TOKENS = itertools.count(1)


def fresh_prompt(tokens: int) -> list[int]:
    """A `tokens`-token prompt whose first token no earlier call of this process gave."""
    if tokens < 1:
        raise ValueError(f"tokens: must be >= 1, got {tokens}")
    return [next(_FIRST_TOKENS)] + [1 + (13 * j) % 30000 for j in range(1, tokens)]


def prefill_uncached(engine: Any, request_id: str, prompt: list[int]) -> None:
    """Prefill `prompt` on `engine` to its first token (the engine's steps until nothing is
    unfinished); RuntimeError if any of its tokens came from the prefix cache, since the time
    around this call would then not be the prompt's prefill."""
    from engine.sampling_params import SamplingParams

    engine.add_request(request_id, prompt, SamplingParams(max_tokens=1))
    cached = 0
    while engine.has_unfinished():
        for out in engine.step().outputs:
            if out.request_id == request_id:
                cached = max(cached, out.num_cached_tokens)
    if cached:
        raise RuntimeError(f"prefill {request_id}: {cached} of its {len(prompt)} prompt tokens "
                           "were in the prefix cache; its time would not be a prefill's")
