"""The start-up warm-up (engine/warmup.py), forced on CPU with a tiny random Llama: it runs
the prefill paths a server meets (a chunked prompt, cached-prefix prefills with a short and
a longer tail, mixed steps, decode; greedy and seeded rows) and leaves the engine as built:
the same pool and scheduler, an empty prefix cache with no events, zero counters, and the
same tokens, seeds and step ids afterwards as an engine that never warmed up."""

from __future__ import annotations

import argparse
import logging
import os
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from tiny_models import PROMPTS, make_tiny_model

from deploy.engine_args import add_engine_args, engine_config, engine_flag_args
from engine import llm as llm_module
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams
from engine.warmup import LONG_TAIL, SHORT_TAIL, SPLIT_CONTEXT, wants_warmup, warm_up

BUDGET = 256
KW = dict(block_size=4, max_num_batched_tokens=BUDGET)
# What the launcher would pick on an H200 (132 SMs) for an 8B model's 32 query heads: the
# step's shape alone decides it, so the tiny model's steps show which variants compile there.
H200_SMS, HEADS_8B = 132, 32


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> str:
    # 1,024 positions: room for a cached prefix past SPLIT_CONTEXT plus the longer tail
    return make_tiny_model(os.path.join(tmp_path_factory.mktemp("warmup"), "llama"), "llama",
                           seed=11, max_position_embeddings=1024)


@dataclass(frozen=True)
class Chunk:
    """One scheduled chunk of a warm-up step, as the runner was handed it."""

    start: int
    num_tokens: int
    prompt_len: int
    cached: int  # the request's prompt tokens found cached at admission
    samples: bool
    greedy: bool
    seed_given: bool

    @property
    def prefill(self) -> bool:
        return self.start < self.prompt_len


def _record(eng: LLMEngine) -> tuple[list[list[Chunk]], list[int], list[int]]:
    """Wraps the runner: every step's chunks, and the prefix cache's hit tokens and the
    engine's preemption count then."""
    steps: list[list[Chunk]] = []
    hits: list[int] = []
    preemptions: list[int] = []
    execute = eng.runner.execute

    def recording(chunks: Any, prev: Any) -> Any:
        steps.append([Chunk(c.start, c.num_tokens, c.request.num_prompt_tokens,
                            c.request.num_cached_tokens or 0, c.samples,
                            c.request.params.greedy, c.request.params.seed is not None)
                      for c in chunks])
        hits.append(eng.prefix_cache_stats().hit_tokens)
        preemptions.append(eng.num_preemptions)
        return execute(chunks, prev)

    eng.runner.execute = recording  # type: ignore[method-assign]
    return steps, hits, preemptions


def _h200_variant(step: list[Chunk]) -> tuple[int, bool, bool]:
    """(query tile rows, keys split, one request) of the prefill attention launch."""
    # kernels.triton_* are imported inside the tests: imported while pytest collects, they
    # would define their @triton.jit functions before tests/kernels/conftest.py sets
    # TRITON_INTERPRET, and every Triton kernel test of a whole-suite run would fail.
    from kernels.triton_prefill_attention import BLOCK_M, SHORT_BLOCK_M
    from kernels.triton_prefill_split import choose_prefill_splits, max_query_tiles, num_sms

    tokens = sum(c.num_tokens for c in step)
    block_m = SHORT_BLOCK_M if tokens <= SHORT_BLOCK_M else BLOCK_M
    longest = max(c.start + c.num_tokens for c in step)
    per_sm = H200_SMS // num_sms(torch.device("cpu"))
    splits = choose_prefill_splits(max_query_tiles(tokens, len(step), block_m), HEADS_8B,
                                   longest, torch.device("cpu"), programs_per_sm=per_sm)
    return block_m, splits > 1, len(step) == 1


def _state(eng: LLMEngine) -> dict[str, Any]:
    """Everything a user or a worker can see of an idle engine, and its seed stream. Last,
    the order the pool hands blocks out in (this takes and gives back every block)."""
    state = dict(
        accounting=eng.block_accounting(), stats=eng.prefix_cache_stats(),
        snapshot=eng.kv_cache_snapshot(), events=eng.drain_kv_events(),
        loads=eng.scheduler.loads(), tokens_computed=eng.scheduler.tokens_computed,
        step_id=eng._step_id, preemptions=eng.num_preemptions,
        seed_stream=eng._seed_rng.getstate(), requests=dict(eng.requests),
        unfinished=eng.has_unfinished())
    every = eng.reserve(eng.blocks.num_blocks * eng.blocks.block_size)
    assert every is not None
    state["allocation_order"] = every
    eng.unreserve(every)
    return state


def test_sizes_select_the_launchers_variants():
    """The tails land on each side of the short-step tile, off multiples of 16 (Triton
    compiles those apart), and the cached context reaches two key splits."""
    from kernels.triton_prefill_attention import BLOCK_M, SHORT_BLOCK_M
    from kernels.triton_prefill_split import MIN_SPLIT_KEYS

    assert SHORT_TAIL <= SHORT_BLOCK_M < LONG_TAIL <= BLOCK_M
    assert SHORT_TAIL % 16 and LONG_TAIL % 16
    assert SPLIT_CONTEXT == 2 * MIN_SPLIT_KEYS


@pytest.mark.parametrize("role", ["colocated", "producer", "consumer"])
def test_the_engine_after_warm_up_is_as_built(model, make_llm, role):
    fresh = make_llm(model, role=role, **KW).engine
    eng = make_llm(model, role=role, **KW).engine
    scheduler, blocks = eng.scheduler, eng.blocks
    steps, hits, _ = _record(eng)
    warm_up(eng)
    assert steps and max(hits) > 0  # it ran, prefix hits included
    assert eng.scheduler is scheduler and eng.blocks is blocks
    assert _state(eng) == _state(fresh)


@pytest.mark.parametrize("role", ["colocated", "producer"])
@pytest.mark.parametrize("seats", [1, 3])
def test_tight_limits_slow_it_down_but_leave_no_trace(model, make_llm, role, seats):
    """A waiting queue of one, a pool of 40 blocks (so max_model_len 160; with 3 seats,
    requests are preempted), a budget of 8 tokens: it still ends, and the engine is as
    built."""
    kw = dict(block_size=4, max_num_batched_tokens=8, max_num_seqs=seats, max_waiting=1,
              num_kv_blocks=40, role=role)
    fresh = make_llm(model, **kw).engine
    eng = make_llm(model, **kw).engine
    steps, hits, preemptions = _record(eng)
    warm_up(eng)
    assert steps and max(hits) > 0
    if seats > 1 and role == "colocated":  # a producer frees a request after its token 0
        assert max(preemptions) > 0
    assert _state(eng) == _state(fresh)


@pytest.mark.parametrize("role", ["colocated", "producer"])
def test_warm_up_runs_every_prefill_path(model, make_llm, role):
    from kernels.triton_prefill_attention import BLOCK_M, SHORT_BLOCK_M

    eng = make_llm(model, role=role, **KW).engine
    steps, hits, _ = _record(eng)
    warm_up(eng)
    chunks = [c for s in steps for c in s]
    # a prompt past the budget: its first chunk, then a continuing one
    assert any(c.start == 0 and c.num_tokens == BUDGET < c.prompt_len for c in chunks)
    assert any(c.prefill and c.start >= BUDGET and c.cached == 0 for c in chunks)
    # prefills after a cached prefix, alone in their step: a short and a longer tail, in a
    # context long enough for key splits
    hit_steps = [s for s in steps if len(s) == 1 and 0 < s[0].cached == s[0].start]
    tails = {c.num_tokens for s in hit_steps for c in s
             if c.start + c.num_tokens >= SPLIT_CONTEXT}
    assert any(n <= SHORT_BLOCK_M for n in tails) and any(n > SHORT_BLOCK_M for n in tails)
    assert max(hits) >= max(c.cached for c in chunks) > 0
    prefill_steps = [s for s in steps if any(c.prefill for c in s)]
    variants = {_h200_variant(s) for s in prefill_steps}
    # one request: 128-query tiles split (short tail) and not (short fresh prompt), 256-query
    # tiles split (longer tail) and not (the budget-sized first chunk); several requests:
    # both tile sizes
    assert {(SHORT_BLOCK_M, True, True), (SHORT_BLOCK_M, False, True), (BLOCK_M, True, True),
            (BLOCK_M, False, True)} <= variants
    assert {v[0] for v in variants if not v[2]} == {SHORT_BLOCK_M, BLOCK_M}
    # several requests after a cached prefix, keys split, in both tile sizes: a loaded
    # producer's steps of shared-prefix questions (one compiled on first use at c=8 on an
    # H200 before the warm-up ran both)
    assert {(SHORT_BLOCK_M, True, False), (BLOCK_M, True, False)} <= variants
    several = [s for s in prefill_steps if len(s) > 1]
    if role == "producer":  # requests end after token 0: no decode beside a prefill
        assert all(c.prefill for s in steps for c in s)
        assert any(c.cached for s in several for c in s)
    else:  # a prefill (a cached-prefix one among them) joining running decodes, then decodes
        mixed = [s for s in several if any(not c.prefill for c in s)]
        assert {sum(c.num_tokens for c in s) <= SHORT_BLOCK_M for s in mixed} == {True, False}
        assert any(c.cached and c.prefill for s in mixed for c in s)
        assert any(not any(c.prefill for c in s) for s in steps)
    # Triton compiles a token count that is a multiple of 16 apart from one that is not:
    # both, for one request after a cached prefix and for steps of several requests
    for kind in (hit_steps, several):
        assert {sum(c.num_tokens for c in s) % 16 == 0 for s in kind} == {True, False}
    sampled = [c for c in chunks if c.samples]
    assert {c.greedy for c in sampled} == {True, False}
    assert all(c.seed_given for c in chunks)  # nothing drawn from the engine's seed stream


GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
SEEDED = SamplingParams(max_tokens=6, temperature=0.9, seed=5, ignore_eos=True)
UNSEEDED = SamplingParams(max_tokens=6, temperature=1.1, top_p=0.9, ignore_eos=True)
PREFIX = [(13 * i + 5) % 256 for i in range(40)]


def _serve(eng: LLMEngine) -> list[Any]:
    """Two waves (the second over the first's cached prefix): what every output reports
    that does not depend on the clock, then the KV events and the cache's stats."""
    seen: list[Any] = []
    waves = [{"g": (PROMPTS[0], GREEDY), "s": (PROMPTS[2], SEEDED), "u": (PROMPTS[3], UNSEEDED),
              "p": (PREFIX + [1, 2, 3], GREEDY)},
             {"q": (PREFIX + [9], SEEDED), "v": (PROMPTS[1], UNSEEDED)}]
    for wave in waves:
        for rid, (prompt, params) in wave.items():
            eng.add_request(rid, prompt, params)
        while eng.has_unfinished():
            seen += [(o.request_id, o.new_token_ids, o.seed, o.sampled_step, o.emitted_step,
                      o.num_cached_tokens, o.state) for o in eng.step().outputs]
        for rid in wave:  # a producer's wait in TRANSFERRING
            eng.release(rid)
    return seen + [eng.drain_kv_events(), eng.prefix_cache_stats(), eng.num_preemptions]


@pytest.mark.parametrize("role", ["colocated", "producer"])
def test_requests_after_warm_up_get_what_they_would_have(model, make_llm, role):
    fresh = make_llm(model, role=role, **KW).engine
    eng = make_llm(model, role=role, **KW).engine
    warm_up(eng)
    got = _serve(eng)
    assert got == _serve(fresh)
    assert any(out[5] == 40 for out in got[:-3])  # the second wave hit the first's prefix


def test_only_cuda_engines_warm_up_and_the_flag_turns_it_off():
    assert wants_warmup(EngineConfig(device="cuda"))
    assert wants_warmup(EngineConfig(device="cuda:1"))
    assert not wants_warmup(EngineConfig(device="cuda", warmup=False))
    assert not wants_warmup(EngineConfig(device="cpu"))
    with pytest.raises(ValueError, match="warmup"):
        EngineConfig(warmup="no")
    p = argparse.ArgumentParser()
    add_engine_args(p)
    defaults = {d: p.get_default(d) for d in p.get_default("engine_dests")}
    on, off = p.parse_args([]), p.parse_args(["--no-warmup"])
    assert engine_config(on).warmup and not engine_config(off).warmup
    # `launch` hands it to its workers as a flag their own parser takes
    assert engine_flag_args(off, defaults) == ("--no-warmup",)
    assert not engine_config(p.parse_args(list(engine_flag_args(off, defaults)))).warmup


def test_build_engine_warms_up_before_it_returns(model, monkeypatch, caplog):
    """On CUDA (forced here) build_engine runs the warm-up; the engine comes back as built."""
    monkeypatch.setattr(llm_module, "wants_warmup", lambda config: True)
    ran: list[LLMEngine] = []
    monkeypatch.setattr(llm_module, "warm_up", lambda eng: ran.append(eng) or warm_up(eng))
    with caplog.at_level(logging.INFO, logger="pdserve.engine"):
        eng = llm_module.build_engine(EngineConfig(model=model, **KW))
    assert ran == [eng]
    assert any(r.getMessage().startswith("warm-up: ") for r in caplog.records)
    fresh = llm_module.build_engine(EngineConfig(model=model, warmup=False, **KW))
    assert _state(eng) == _state(fresh)


def test_tensor_parallel_followers_and_every_attention_group_run_it(tmp_path):
    """TP2 with two attention groups (MoE): every warm-up step gives both groups work (each
    group's ranks compile their own kernels), and afterwards both pools are whole, the
    caches empty, and tokens equal a one-rank engine's."""
    moe = make_tiny_model(str(tmp_path / "moe"), "qwen3_moe", seed=4)
    kw: dict[str, Any] = dict(block_size=4, max_num_batched_tokens=64)
    with llm_module.LLM(moe, **kw) as one:
        want = [c.token_ids for c in one.generate(PROMPTS, GREEDY)]
    with llm_module.LLM(moe, tensor_parallel_size=2, data_parallel_size=2, **kw) as llm:
        eng = llm.engine
        groups: list[set[int]] = []
        execute = eng.runner.execute

        def recording(chunks: Any, prev: Any) -> Any:
            groups.append({c.request.dp_rank for c in chunks})
            return execute(chunks, prev)

        eng.runner.execute = recording
        warm_up(eng)
        assert groups and all(g == {0, 1} for g in groups)
        assert [ld["kv_blocks_free"] == ld["kv_blocks_total"] for ld in eng.scheduler.loads()] \
            == [True, True]
        assert eng.prefix_cache_stats().hit_tokens == 0 and not eng.drain_kv_events()
        assert eng._step_id == 0
        assert [c.token_ids for c in llm.generate(PROMPTS, GREEDY, dp_ranks=[0, 1, 1, 0])] \
            == want


def test_an_engine_holding_requests_is_refused(model, make_llm):
    eng = make_llm(model, **KW).engine
    eng.add_request("r", PROMPTS[0], GREEDY)
    with pytest.raises(RuntimeError, match="already holds requests"):
        warm_up(eng)
    eng.abort("r")
