"""Measuring one worker for its profile, with the real engine on its device.

Prefill: one step that computes T prompt tokens (a fresh request of T tokens, T within the
step's token budget), median of a few. Decode: B requests of context C prefilled first,
then the median of a few decode steps of all B. Output is never deferred here, so each
``step()`` call times exactly one forward and its sampling.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

from deploy.plan.profile import DecodeGrid, PrefillCurve, Profile
from deploy.plan.transfer_probe import measure_transfer_GBps
from engine.config import EngineConfig
from engine.llm import build_engine
from engine.llm_engine import LLMEngine
from engine.model_source import EMBEDDED_NAME
from engine.sampling_params import SamplingParams

TOKEN_ID = 1000  # any ordinary id (below the vocabulary size): the cost does not depend on it


@dataclass(frozen=True)
class Grid:
    prefill_tokens: tuple[int, ...] = (16, 64, 128, 256, 512)
    decode_batch: tuple[int, ...] = (1, 4, 16)
    decode_context: tuple[int, ...] = (64, 512)
    reps: int = 3  # timed repetitions per point (the median is kept)


def _timed_step(engine: LLMEngine) -> float:
    t0 = time.perf_counter()
    engine.step()
    return (time.perf_counter() - t0) * 1e3


def _token(engine: LLMEngine) -> int:
    return min(TOKEN_ID, engine.model_cfg.vocab_size - 1)


def _prefill_ms(engine: LLMEngine, tokens: int, reps: int, rid: Callable[[], str]) -> float:
    params = SamplingParams(max_tokens=1, ignore_eos=True, temperature=0.0)
    times = []
    for i in range(reps + 1):  # the first run warms this shape up
        r = rid()
        engine.add_request(r, [_token(engine)] * tokens, params)
        times.append(_timed_step(engine))
        while engine.has_unfinished():
            engine.step()
        if i == 0:
            times.clear()
    return statistics.median(times)


def _decode_ms(engine: LLMEngine, batch: int, context: int, reps: int,
               rid: Callable[[], str]) -> float:
    # Enough tokens that none finishes (and leaves the batch) while the others still prefill.
    params = SamplingParams(max_tokens=engine.max_model_len - context, ignore_eos=True,
                            temperature=0.0)
    ids = [rid() for _ in range(batch)]
    for r in ids:
        engine.add_request(r, [_token(engine)] * context, params)
    # prefill every request, then one step more so the batch is decode-only
    while any(engine.requests[r].num_computed_tokens < context for r in ids):
        engine.step()
    engine.step()
    times = [_timed_step(engine) for _ in range(reps)]
    for r in ids:
        engine.abort(r)
    while engine.has_unfinished():
        engine.step()
    return statistics.median(times)


def measure_profile(config: EngineConfig, grid: Grid, transfer_backend: str = "ucx",
                    log: Callable[[str], None] = print) -> Profile:
    # No prefix cache: every repetition resends the same prompt, and a hit would time a
    # one-token prefill instead of T tokens.
    config = dataclasses.replace(config, role="colocated", defer_output=False,
                                 enable_prefix_caching=False)
    engine = build_engine(config)
    counter = iter(range(1 << 62))

    def rid() -> str:
        return f"profile-{next(counter)}"

    budget = config.max_num_batched_tokens
    tokens = tuple(t for t in grid.prefill_tokens if t <= min(budget, engine.max_model_len - 1))
    if not tokens:
        raise ValueError(f"--prefill-tokens: no grid point fits the step budget ({budget})")
    pms = []
    for t in tokens:
        pms.append(_prefill_ms(engine, t, grid.reps, rid))
        log(f"prefill {t:>6} tokens: {pms[-1]:8.2f} ms")
    batch = tuple(b for b in grid.decode_batch if b <= config.max_num_seqs)
    ctx = tuple(c for c in grid.decode_context if c + grid.reps + 4 < engine.max_model_len)
    blocks_total = engine.block_accounting().total
    rows: list[list[float]] = []
    for b in batch:
        row = []
        for c in ctx:
            if b * -(-(c + grid.reps + 4) // config.block_size) > blocks_total:
                raise ValueError(f"--decode-batch: {b} x {c} tokens does not fit the KV pool")
            row.append(_decode_ms(engine, b, c, grid.reps, rid))
            log(f"decode batch {b:>4} context {c:>6}: {row[-1]:8.2f} ms")
        rows.append(row)
    layout = engine.layout
    gbps = measure_transfer_GBps(dataclasses.replace(layout, num_blocks=1),
                                 tokens=max(tokens), backend=transfer_backend)
    log(f"transfer: {gbps:.3f} GB/s")
    # the --model value as given: the plan's launch line repeats it (layout.model is a digest)
    return Profile(model=config.model or EMBEDDED_NAME, device=str(engine.device),
                   block_size=config.block_size,
                   prefill=PrefillCurve(tokens, tuple(pms)),
                   decode=DecodeGrid(batch, ctx, tuple(tuple(r) for r in rows)),
                   kv_capacity_tokens=layout.num_blocks * config.block_size,
                   kv_bytes_per_token=layout.block_nbytes // config.block_size,
                   transfer_GBps=gbps)


def parse_ints(flag: str, text: str) -> tuple[int, ...]:
    try:
        vals = tuple(int(x) for x in text.split(","))
    except ValueError:
        raise ValueError(f"{flag}: expected comma-separated integers, got {text!r}") from None
    if not vals or any(v < 1 for v in vals) or list(vals) != sorted(set(vals)):
        raise ValueError(f"{flag}: expected increasing positive integers, got {text!r}")
    return vals


