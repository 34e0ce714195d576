"""Measuring one worker for its profile, with the real engine on its device.

Prefill: one step that computes T prompt tokens (a fresh request of T tokens, T within the
step's token budget). Decode: B requests of context C prefilled first, then decode steps of
all B. Output is never deferred here, so each ``step()`` call times exactly one forward and
its sampling. A worker of attention data-parallel groups runs each point on every group at
once (T tokens, B requests per group), as its profile counts them.

A busy machine makes single timings worthless (a 128-token prefill once took 7.6 s, 512
tokens 0.8 s), so each point is sampled until its last ``reps`` timings agree within
``tolerance`` (relative spread, (max - min) / median), up to ``max_reps`` timings; the
point is their median and the spread is recorded. A point still noisy, or a curve that
falls where cost must grow (more tokens, a bigger batch, a longer context), is measured once
more; what is still wrong then is listed in the profile's ``problems``, which `pdserve plan`
refuses to plan on.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

from deploy.plan.profile import (
    DEFAULT_TOLERANCE,
    DecodeGrid,
    PrefillCurve,
    Profile,
    out_of_order,
    problems,
)
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
    reps: int = 3  # timings per point that must agree (their median is kept)
    max_reps: int = 15  # timings per point at most while they do not agree
    tolerance: float = DEFAULT_TOLERANCE  # the relative spread under which timings agree


def _timed_step(engine: LLMEngine) -> float:
    t0 = time.perf_counter()
    engine.step()
    return (time.perf_counter() - t0) * 1e3


def _token(engine: LLMEngine) -> int:
    return min(TOKEN_ID, engine.model_cfg.vocab_size - 1)


def spread(times: list[float]) -> float:
    """Relative spread of timings: (max - min) / median."""
    return (max(times) - min(times)) / statistics.median(times)


def stable(sample: Callable[[], float], grid: Grid) -> tuple[float, float]:
    """(median, spread) of the last ``grid.reps`` timings of ``sample``, taking timings
    until those agree within ``grid.tolerance`` or ``grid.max_reps`` were taken."""
    times: list[float] = []
    while True:
        times.append(sample())
        window = times[-grid.reps:]
        if len(window) == grid.reps and (spread(window) <= grid.tolerance
                                         or len(times) >= max(grid.max_reps, grid.reps)):
            return statistics.median(window), spread(window)


def _groups(engine: LLMEngine) -> int:
    """Attention data-parallel groups: each runs a point's whole part at once."""
    return engine.config.data_parallel_size


def _prefill_ms(engine: LLMEngine, tokens: int, grid: Grid,
                rid: Callable[[], str]) -> tuple[float, float]:
    params = SamplingParams(max_tokens=1, ignore_eos=True, temperature=0.0)

    def once() -> float:
        for g in range(_groups(engine)):
            engine.add_request(rid(), [_token(engine)] * tokens, params,
                               dp_rank=g if _groups(engine) > 1 else None)
        ms = _timed_step(engine)
        while engine.has_unfinished():
            engine.step()
        return ms

    once()  # warms this shape up
    return stable(once, grid)


def _decode_ms(engine: LLMEngine, batch: int, context: int, grid: Grid,
               rid: Callable[[], str]) -> tuple[float, float]:
    # Enough tokens that none finishes (and leaves the batch) while the others still prefill.
    params = SamplingParams(max_tokens=engine.max_model_len - context, ignore_eos=True,
                            temperature=0.0)
    d = _groups(engine)
    ids = [rid() for _ in range(batch * d)]  # batch on every group
    for i, r in enumerate(ids):
        engine.add_request(r, [_token(engine)] * context, params,
                           dp_rank=i % d if d > 1 else None)
    # prefill every request, then one step more so the batch is decode-only
    while any(engine.requests[r].num_computed_tokens < context for r in ids):
        engine.step()
    engine.step()
    result = stable(lambda: _timed_step(engine), grid)
    for r in ids:
        engine.abort(r)
    while engine.has_unfinished():
        engine.step()
    return result


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
    def prefill(i: int) -> None:
        pms[i], psp[i] = _prefill_ms(engine, tokens[i], grid, rid)
        log(f"prefill {tokens[i]:>6} tokens: {pms[i]:8.2f} ms  (spread {100 * psp[i]:.0f}%)")

    pms = [0.0] * len(tokens)
    psp = [0.0] * len(tokens)
    for i in range(len(tokens)):
        prefill(i)
    steps = max(grid.max_reps, grid.reps) + 4  # decode steps a point may take
    batch = tuple(b for b in grid.decode_batch if b <= config.max_num_seqs)
    ctx = tuple(c for c in grid.decode_context if c + steps < engine.max_model_len)
    blocks_total = engine.blocks.num_blocks  # one group's pool
    rows = [[0.0] * len(ctx) for _ in batch]
    dsp = [[0.0] * len(ctx) for _ in batch]

    def decode(i: int, j: int) -> None:
        rows[i][j], dsp[i][j] = _decode_ms(engine, batch[i], ctx[j], grid, rid)
        log(f"decode batch {batch[i]:>4} context {ctx[j]:>6}: {rows[i][j]:8.2f} ms  "
            f"(spread {100 * dsp[i][j]:.0f}%)")

    for i, b in enumerate(batch):
        for j, c in enumerate(ctx):
            if b * -(-(c + steps) // config.block_size) > blocks_total:
                raise ValueError(f"--decode-batch: {b} x {c} tokens does not fit the KV pool")
            decode(i, j)
    # One more measurement of every point that is noisy or out of order (both points of a
    # pair: either may be the wrong one); what is still wrong after it stays a problem.
    again = {i for i in range(len(tokens)) if psp[i] > grid.tolerance}
    again |= {k for i in out_of_order(tokens, pms, psp) for k in (i - 1, i)}
    for i in sorted(again):
        log(f"measuring prefill {tokens[i]} tokens again")
        prefill(i)
    redo = {(i, j) for i in range(len(batch)) for j in range(len(ctx))
            if dsp[i][j] > grid.tolerance}
    for i in range(len(batch)):
        redo |= {(i, k) for j in out_of_order(ctx, rows[i], dsp[i]) for k in (j - 1, j)}
    for j in range(len(ctx)):
        col, col_sp = [r[j] for r in rows], [r[j] for r in dsp]
        redo |= {(k, j) for i in out_of_order(batch, col, col_sp) for k in (i - 1, i)}
    for i, j in sorted(redo):
        log(f"measuring decode batch {batch[i]} context {ctx[j]} again")
        decode(i, j)
    layout = engine.layout
    gbps = measure_transfer_GBps(dataclasses.replace(layout, num_blocks=1),
                                 tokens=max(tokens), backend=transfer_backend)
    log(f"transfer: {gbps:.3f} GB/s")
    # the --model value as given: the plan's launch line repeats it (layout.model is a digest)
    profile = Profile(model=config.model or EMBEDDED_NAME, device=str(engine.device),
                      block_size=config.block_size,
                      prefill=PrefillCurve(tokens, tuple(pms)),
                      decode=DecodeGrid(batch, ctx, tuple(tuple(r) for r in rows)),
                      kv_capacity_tokens=layout.num_blocks * config.block_size,
                      kv_bytes_per_token=layout.block_nbytes // config.block_size,
                      transfer_GBps=gbps, prefill_spread=tuple(psp),
                      decode_spread=tuple(tuple(r) for r in dsp), tolerance=grid.tolerance,
                      tp_size=config.tensor_parallel_size, dp_size=config.data_parallel_size)
    return dataclasses.replace(profile, problems=tuple(problems(profile, grid.tolerance)))


def parse_ints(flag: str, text: str) -> tuple[int, ...]:
    try:
        vals = tuple(int(x) for x in text.split(","))
    except ValueError:
        raise ValueError(f"{flag}: expected comma-separated integers, got {text!r}") from None
    if not vals or any(v < 1 for v in vals) or list(vals) != sorted(set(vals)):
        raise ValueError(f"{flag}: expected increasing positive integers, got {text!r}")
    return vals


