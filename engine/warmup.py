"""Start-up warm-up: a few real requests through the engine's own add_request/step, so the
first requests a server takes do not wait for Triton's first-use compiles.

Triton compiles a kernel once per specialization: its constexprs (the prefill attention's
query tile, 128 rows for a step of at most 128 tokens and 256 beyond; whether the keys are
split, which kernels/triton_prefill_split.choose_prefill_splits decides from the step's
query tiles, heads and longest context) and its integer arguments equal to 1 or divisible
by 16 (request count, token count, block-table width). Capturing the decode graphs
(engine/decode_graphs.py) compiles decode; nothing compiled the prefill paths before a
request took them: on an H200 a benchmark point whose requests hit the prefix cache had a
TTFT p50 of ~3 s on a fresh machine and 107 ms once its kernels were compiled.

What runs, one copy per attention data-parallel group (placed on it, so every group's ranks
compile at the same time), each phase to its end:

1. a prompt longer than the token budget: a first chunk and a continuing one (a long
   context, a short query), then two decode steps; its full blocks become the cached prefix;
2. that prefix plus a short tail (<= 128 tokens: 128-query tiles, keys split when the
   context is long) and, alone after it, plus a longer tail (256-query tiles, split when
   its few tiles leave SMs idle): prefix-cache hits, one request per step as an idle
   server meets them; then two hits together in one step, past 128 tokens and within
   (query tiles over several requests, keys split), as a loaded producer meets them;
3. a short request reaches decode; a prefix hit with a short tail and a fresh short prompt
   join it (a mixed step of <= 128 tokens: a consumer's local prefill beside its decodes),
   then a fresh longer prompt and another short one (a mixed step past 128 tokens), then
   decodes alone. On a producer, whose requests end after token 0, these are steps of
   several prompts, as a loaded producer runs.

Rows sample greedily and with a seeded temperature (the simple sampler, in the decode
graphs' head too). Phases 2 and 3 run once per set of sizes in SIZES: first with sizes
that are not multiples of 16, then with ones that are (a step's token count, its tails),
since Triton compiles the two apart. A shared-prefix benchmark's 128-token questions on a
loaded producer make steps of 256 or 384 tokens: with only the first set, those steps
compiled on first use (a 2 s TTFT p99 at c=8 on an H200).

The engine is left as built. The requests run against a throwaway scheduler over throwaway
block managers, each with its own prefix cache (so hits happen with caching off too; a
late chunk of a long prompt selects the same kernels there); the engine's own scheduler,
pool, prefix cache, its KV events (and their sequence numbers) and stats are put back
untouched, as are the step counter and the preemption count. Every request names its seed,
so none is drawn from the engine's seed stream that gives later unseeded requests theirs.
What the requests wrote into the KV pool's memory is never read: a request reads only
positions it computed or blocks the (empty) prefix cache gave it.

It runs inside engine.llm.build_engine, before any role handler or KV-event forwarder
exists: no hook sees these requests. Tensor-parallel followers run every step too (the
runner sends them each plan), as they do when serving.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from engine.block_manager import BlockManager
from engine.compile_watch import process_watch
from engine.config import EngineConfig
from engine.dp_scheduler import make_scheduler
from engine.prefix_cache import PrefixCache
from engine.request import Request
from engine.request_state import RequestState
from engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from engine.llm_engine import LLMEngine

log = logging.getLogger("pdserve.engine")

# Tails after the cached prefix, sized for the prefill attention launcher's choices
# (kernels/triton_prefill_attention.py): at most SHORT_BLOCK_M (128) tokens, 128-query
# tiles; up to BLOCK_M (256), one 256-query tile. tests/engine/test_warmup.py checks them
# against those constants.
SHORT_TAIL = 37
LONG_TAIL = 200
# The least context the cached prefix gives the tails where max_model_len allows: keys are
# split only when each split keeps MIN_SPLIT_KEYS (256) keys, so two splits need 512.
SPLIT_CONTEXT = 512
FRESH = 23  # a short prompt with nothing cached
# (short tail, long tail, fresh prompt) per pass of phases 2 and 3: token counts off and on
# multiples of 16 (a mixed step's decoding row adds one: 1 + 32 + 15 = 48, 1 + 192 + 15 = 208)
SIZES = ((SHORT_TAIL, LONG_TAIL, FRESH), (32, 192, 16), (32, 192, 15))
DECODER = 11  # the prompt of the request that decodes beside the later prefills
OUT = 3  # output tokens of most warm-up requests: token 0, then two decode steps


def wants_warmup(config: EngineConfig) -> bool:
    """Whether build_engine warms this engine up: on CUDA only (Triton compiles there; CPU
    runs the torch references), unless --no-warmup."""
    return config.warmup and torch.device(config.device).type == "cuda"


def warm_up(engine: LLMEngine) -> None:
    """Runs the warm-up (module docstring) on an engine that has served nothing yet, and
    logs how long it took; the engine is then as it was."""
    if engine.requests or engine.has_unfinished():
        raise RuntimeError("warm_up: the engine already holds requests; warm it up at build, "
                           "before it serves")
    if engine.max_model_len < 2:  # no request fits (a prompt and one output token)
        return
    start = time.perf_counter()
    watch = process_watch()
    compiles, compile_s = watch.compiles, watch.compile_s
    own = engine.blocks, engine.scheduler, engine._step_id, engine.num_preemptions
    throwaway = BlockManager(engine.blocks.num_blocks, engine.blocks.block_size, PrefixCache())
    engine.blocks = throwaway
    engine.scheduler = make_scheduler(
        dataclasses.replace(engine.config, enable_prefix_caching=True), throwaway,
        engine.max_model_len)
    run = _Run(engine)
    run.phases()
    assert not engine.requests and engine._inflight is None and not engine._unread \
        and not engine._free_after, "warm-up requests left behind"
    engine.blocks, engine.scheduler, engine._step_id, engine.num_preemptions = own
    log.info("warm-up: %d steps in %.1f s, %d Triton compiles (%.1f s): prefill, mixed and "
             "decode kernels compiled before serving", run.steps, time.perf_counter() - start,
             watch.compiles - compiles, watch.compile_s - compile_s)


class _Run:
    """The warm-up's requests and steps on one engine (already on its throwaway scheduler)."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self.steps = 0
        self._ids: list[str] = []
        self._vocab = engine.model_cfg.vocab_size
        room = engine.max_model_len  # prompt + outputs of one request (the pool holds it)
        self.out = min(OUT, room - 1)
        budget = engine.config.max_num_batched_tokens
        bs = engine.config.block_size
        # > budget where max_model_len allows: a first chunk and a continuing one
        self.first = min(max(budget, SPLIT_CONTEXT) + SHORT_TAIL, room - self.out)
        # the hits' cached tokens: whole blocks of the first prompt, leaving room for the
        # longer tail after them (half the room where max_model_len is too short for both)
        keep = max(room - self.out - LONG_TAIL, (room - self.out) // 2)
        self.prefix = bs * (min(self.first - 1, keep) // bs)
        self.room, self.budget = room, budget
        self.decoder = min(DECODER, room - self.out)

    def phases(self) -> None:
        greedy = _params(self.out, seeded=False)
        seeded = _params(self.out, seeded=True)
        first = self._tokens(self.first, salt=0)
        self._add("chunked", first, greedy)
        self._finish()
        cached = first[:self.prefix]
        for n, (short_tail, long_tail, fresh) in enumerate(SIZES):
            # each pass its own prompts past the prefix: an earlier pass's tail, cached,
            # would make this one's a different (shorter) chunk
            salt = 10 * n
            room = self.room - self.out
            long_fresh = min(long_tail, room)
            short_tail = min(short_tail, room - self.prefix)
            long_tail = min(long_tail, room - self.prefix)
            fresh = min(fresh, room)
            self._add(f"hit-short{n}", cached + self._tokens(short_tail, salt + 1), seeded)
            self._finish()
            self._add(f"hit-long{n}", cached + self._tokens(long_tail, salt + 2), greedy)
            self._finish()
            # two hits in one step, past 128 tokens and within: query tiles over several
            # requests, keys split (a loaded producer's steps of cached-prefix questions; on
            # an H200 their first use stalled a shared-prefix benchmark at c=8 for 1.4-2.7 s)
            for k, tail in enumerate((long_tail, short_tail)):
                self._add(f"hits-together{n}-{k}a", cached + self._tokens(tail, salt + 8 + k),
                          seeded)
                self._add(f"hits-together{n}-{k}b",
                          cached + self._tokens(short_tail, salt + 10 + k), greedy)
                self._finish()
            # the decoder still decodes when the longer fresh prompt's chunk is scheduled
            # (one output per step, the prefills before it taking up to the budget each step)
            behind = -(-(short_tail + 2 * fresh + long_fresh) // self.budget)
            decoder = self._add(f"decoder{n}", self._tokens(self.decoder, salt + 3),
                                _params(min(self.out + behind, self.room - self.decoder),
                                        seeded=False))
            self._step_until(lambda: _sampled(decoder))  # noqa: B023 - called at once
            short = self._add(f"mixed-hit{n}", cached + self._tokens(short_tail, salt + 4),
                              seeded)
            short += self._add(f"mixed-fresh{n}", self._tokens(fresh, salt + 5), greedy)
            self._step_until(lambda: _sampled(short))  # noqa: B023 - called at once
            self._add(f"mixed-long{n}", self._tokens(long_fresh, salt + 6), seeded)
            self._add(f"mixed-long-fresh{n}", self._tokens(fresh, salt + 7), greedy)
            self._finish()

    def _tokens(self, n: int, salt: int) -> list[int]:
        """n token ids; prompts of different salts differ from their first token, so they
        share only the cached blocks the phases give them."""
        return [(salt * 7919 + 31 * i + 3) % self._vocab for i in range(n)]

    def _add(self, name: str, prompt: list[int], params: SamplingParams) -> list[Request]:
        """One copy of the request per attention group, placed on it."""
        reqs = []
        limit = self.engine.config.max_waiting
        for g in range(self.engine.config.data_parallel_size):
            # a full waiting queue (a small --max-waiting) would refuse it: let some in first
            self._step_until(lambda: len(self.engine.scheduler.waiting) < limit)
            rid = f"warmup-{name}-{g}"
            reqs.append(self.engine.add_request(rid, prompt, params, dp_rank=g))
            self._ids.append(rid)
        return reqs

    def _step_until(self, done: Callable[[], bool]) -> None:
        while not done():
            assert self.engine.has_unfinished(), "warm-up requests stalled"
            self.engine.step()
            self.steps += 1
            # A producer's requests wait in TRANSFERRING, holding their blocks, for a
            # transfer that never comes: freed at once, as an acknowledgement would (kept,
            # they could leave a small pool too full for the next request).
            for rid in self._ids:
                if self.engine.state_of(rid) == RequestState.TRANSFERRING:
                    self.engine.release(rid)

    def _finish(self) -> None:
        self._step_until(lambda: not self.engine.has_unfinished())
        self._ids.clear()


def _params(max_tokens: int, seeded: bool) -> SamplingParams:
    # seed given either way: a request without one draws it from the engine's seed stream,
    # which would shift the seeds of every later request that gives none
    return SamplingParams(max_tokens=max_tokens, temperature=0.8 if seeded else 0.0, seed=0,
                          ignore_eos=True)


def _sampled(reqs: list[Request]) -> bool:
    """Every request's first output token has been launched (a producer's is then read)."""
    return all(r.output_token_ids for r in reqs)
