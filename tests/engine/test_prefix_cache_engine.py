"""The prefix cache in a running engine (tiny random model, CPU): hits skip prefill, tokens are
the same with the cache on and off, every path gives its blocks back, events and reuse."""

from __future__ import annotations

import argparse

import pytest
from tiny_models import PROMPTS

from deploy.engine_args import add_engine_args, engine_config
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.outputs import RequestOutput
from engine.prefix_cache import BlocksRemoved, BlocksStored
from engine.prefix_hash import block_hashes, chain_root
from engine.request_state import RequestState
from engine.sampling_params import SamplingParams

BS = 4
GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
SEEDED = SamplingParams(max_tokens=6, temperature=0.9, top_p=0.9, seed=3, ignore_eos=True,
                        repetition_penalty=1.2)
PREFIX = [(7 * i + 3) % 250 for i in range(24)]  # 6 full blocks


def _run(eng: LLMEngine, reqs: dict[str, tuple[list[int], SamplingParams]],
         salt: str | None = None) -> dict[str, tuple[list[int], int]]:
    """Runs the requests together to the end: id -> (tokens, num_cached_tokens)."""
    for rid, (prompt, params) in reqs.items():
        eng.add_request(rid, prompt, params, cache_salt=salt)
    got: dict[str, tuple[list[int], int]] = {rid: ([], -1) for rid in reqs}
    while eng.has_unfinished():
        for o in eng.step().outputs:
            toks, _ = got[o.request_id]
            got[o.request_id] = (toks + o.new_token_ids, o.num_cached_tokens)
    return got


def _pool_whole(eng: LLMEngine) -> None:
    """No block has an owner, every cached block is evictable, the accounting adds up."""
    assert all(eng.blocks.refcount(b) == 0 for b in range(eng.blocks.num_blocks))
    acc = eng.block_accounting()
    assert acc.free == acc.total and acc.used == 0
    stats = eng.prefix_cache_stats()
    assert stats.cached_blocks == stats.evictable_blocks == acc.cached
    assert not eng.requests and not eng.scheduler.running and not eng._free_after


def test_shared_prefix_is_computed_once(tiny_models, make_llm):
    path = tiny_models["llama"]
    runs = {}
    for on in (True, False):
        eng = make_llm(path, block_size=BS, enable_prefix_caching=on).engine
        first = _run(eng, {"a": (PREFIX + [1, 2, 3], GREEDY)})
        before = eng.scheduler.tokens_computed
        second = _run(eng, {"b": (PREFIX + [4, 5], GREEDY)})
        runs[on] = (first, second, eng.scheduler.tokens_computed - before)
        _pool_whole(eng)
        stats = eng.prefix_cache_stats()
        assert stats.enabled is on
        if on:
            assert (stats.queried_tokens, stats.hit_tokens) == (27 + 26, 24)
    (a_on, b_on, computed_on), (a_off, b_off, computed_off) = runs[True], runs[False]
    assert a_on == a_off and b_on["b"][0] == b_off["b"][0]  # same tokens
    assert a_on["a"][1] == 0 and b_on["b"][1] == 24 and b_off["b"][1] == 0
    # b's prefill: 2 tokens instead of 26; its 5 decodes either way
    assert (computed_on, computed_off) == (2 + 5, 26 + 5)


@pytest.mark.parametrize("defer", [True, False], ids=["deferred", "direct"])
@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_same_tokens_with_the_cache_on_and_off(tiny_models, make_llm, params, defer):
    """Shared prefixes, a repeated prompt, exact multiples of the block size, a prompt that
    is a prefix of another, a second turn over a first turn's output (decode-written
    blocks), chunked prefill (16-token steps) and requests running together."""
    path = tiny_models["qwen2"]
    wave1 = {"a": PREFIX + [1, 2, 3], "b": PREFIX[:16], "c": PROMPTS[2]}
    out = {}
    for on in (True, False):
        eng = make_llm(path, block_size=BS, max_num_batched_tokens=16, defer_output=defer,
                       enable_prefix_caching=on).engine
        got = _run(eng, {k: (p, params) for k, p in wave1.items()})
        turn2 = wave1["c"] + got["c"][0] + [9, 9]
        wave2 = {"a2": PREFIX + [1, 2, 3], "b2": PREFIX[:16], "d": PREFIX[:20] + [4],
                 "e": PREFIX[:12], "c2": turn2}
        got2 = _run(eng, {k: (p, params) for k, p in wave2.items()})
        out[on] = ({k: t for k, (t, _) in got.items()}, {k: t for k, (t, _) in got2.items()},
                   {k: n for k, (_, n) in got2.items()})
        _pool_whole(eng)
    assert out[True][:2] == out[False][:2]
    cached = out[True][2]
    # every full block but the last token's: 24 of 27, 12 of 16 (exact multiple: the last
    # block is recomputed for its last token), 20 of 21, 8 of 12; turn 2 reuses turn 1's
    # prompt and the output blocks its decode wrote
    assert cached["a2"] == 24 and cached["b2"] == 12 and cached["d"] == 20
    assert cached["e"] == 8
    assert cached["c2"] == (len(wave1["c"]) + 6 - 1) // BS * BS
    assert set(out[False][2].values()) == {0}


def test_a_fully_cached_prompt_still_computes_its_last_token(tiny_models, make_llm):
    eng = make_llm(tiny_models["llama"], block_size=BS).engine
    for prompt in (PREFIX[:16], PREFIX[:18]):
        ref = _run(eng, {"ref": (prompt, GREEDY)})["ref"][0]
        before = eng.scheduler.tokens_computed
        tokens, cached = _run(eng, {"again": (prompt, GREEDY)})["again"]
        assert tokens == ref
        # 16 tokens: blocks 0-2 hit, block 3 is recomputed (its 4 tokens); 18: all 4 hit
        assert cached == (12 if len(prompt) == 16 else 16)
        assert eng.scheduler.tokens_computed - before == len(prompt) - cached + 5
    _pool_whole(eng)


def test_refcounts_return_to_zero_on_every_path(tiny_models, make_llm):
    """Finish, abort in QUEUED / PREFILLING (holding hit blocks) / DECODING (its step in
    flight), preemption by a tiny pool: nothing leaks, the cache stays consistent."""
    eng = make_llm(tiny_models["llama"], block_size=BS, max_num_batched_tokens=8).engine
    _run(eng, {"warm": (PREFIX, GREEDY)})
    long = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
    eng.add_request("queued", PREFIX + [1], long)
    eng.abort("queued")  # QUEUED: never held a block
    eng.add_request("prefilling", PREFIX + list(range(40, 60)), long)
    eng.step()
    r = eng.requests["prefilling"]
    assert r.state == RequestState.PREFILLING and r.num_cached_tokens == 24
    hit = r.block_ids[:6]
    assert all(eng.blocks.refcount(b) == 1 for b in hit)
    eng.abort("prefilling")
    eng.add_request("decoding", PREFIX + [2], long)
    while eng.requests["decoding"].state != RequestState.DECODING or eng._inflight is None:
        eng.step()
    held = list(eng.requests["decoding"].block_ids)
    eng.abort("decoding")
    # deferred output: the launched step still writes its blocks, so they wait for its read
    assert all(eng.blocks.refcount(b) == 1 for b in held)
    eng.step()
    _pool_whole(eng)
    assert eng.cached_prefix_blocks(PREFIX) == 6  # still cached, now unowned


def test_blocks_are_cached_once_the_step_that_wrote_them_is_read(tiny_models, make_llm):
    """Deferred output: a launched step may still be running on the device, so its blocks
    join the cache when it is read back (a transfer reading a cached block is not ordered
    after the device's work)."""
    eng = make_llm(tiny_models["llama"], block_size=BS, max_num_batched_tokens=8).engine
    eng.add_request("r", PREFIX, GREEDY)
    eng.step()  # launches positions 0-7
    assert eng._inflight is not None and eng.cached_prefix_blocks(PREFIX) == 0
    eng.step()  # launches 8-15, reads 0-7
    assert eng.cached_prefix_blocks(PREFIX) == 2
    while eng.has_unfinished():
        eng.step()
    assert eng.cached_prefix_blocks(PREFIX) == 6
    _pool_whole(eng)


def test_a_stop_under_deferred_output_frees_after_the_launched_step(tiny_models, make_llm):
    """A request that stops while the next step (launched with it) is in flight keeps its
    blocks until that step is read; then its full blocks stay cached, unowned."""
    eng = make_llm(tiny_models["llama"], block_size=BS).engine
    prompt = PREFIX[:10]
    ref = _run(eng, {"ref": (prompt, GREEDY)}, salt="ref")["ref"][0]
    j = ref.index(ref[2])  # the stop token's first appearance
    stop = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, stop_token_ids=[ref[2]])
    eng.add_request("s", prompt, stop)
    while True:
        held = list(eng.requests["s"].block_ids)
        res = eng.step()
        if "s" in res.finished:
            break
    assert res.outputs[-1].new_token_ids[-1] == ref[2]
    assert res.outputs[-1].num_output_tokens == j + 1
    assert eng._inflight is not None and all(eng.blocks.refcount(b) == 1 for b in held)
    eng.step()  # reads the launched step: now the blocks go
    _pool_whole(eng)
    assert eng.cached_prefix_blocks(prompt) == 2


@pytest.mark.parametrize("defer", [True, False], ids=["deferred", "direct"])
def test_preemption_with_the_cache_gives_the_same_tokens(tiny_models, make_llm, defer):
    path = tiny_models["llama"]
    params = [SamplingParams(max_tokens=24, temperature=0, ignore_eos=True),
              SamplingParams(max_tokens=24, temperature=0.8, seed=5, ignore_eos=True,
                             frequency_penalty=0.4)] * 2
    prompts = [PREFIX + p[:8] for p in PROMPTS]  # shared prefix: shared blocks to preempt
    ref = make_llm(path, block_size=BS, enable_prefix_caching=False).generate(prompts, params)
    small = make_llm(path, block_size=BS, num_kv_blocks=24, defer_output=defer)
    got = small.generate(prompts, params)
    assert small.engine.num_preemptions > 0
    assert [g.token_ids for g in got] == [r.token_ids for r in ref]
    _pool_whole(small.engine)


def test_lru_keeps_the_most_recently_released_prefixes(tiny_models, make_llm):
    eng = make_llm(tiny_models["llama"], block_size=BS, num_kv_blocks=16).engine
    one = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    prompts = {k: [k] * 12 + [k + 1] for k in (10, 20, 30)}  # 3 full blocks each
    for k, p in prompts.items():
        _run(eng, {f"p{k}": (p, one)})
    assert [eng.cached_prefix_blocks(p) for p in prompts.values()] == [3, 3, 3]
    # 9 cached of 16: a 40-token request needs 10 blocks, so 3 cached ones go, the oldest
    _run(eng, {"big": (list(range(100, 139)), one)})
    assert [eng.cached_prefix_blocks(p) for p in prompts.values()] == [0, 3, 3]
    _pool_whole(eng)


def test_events_and_lookups_follow_the_cache(tiny_models, make_llm):
    eng = make_llm(tiny_models["llama"], block_size=BS, num_kv_blocks=16).engine
    one = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    _run(eng, {"a": (PREFIX[:13], one)})
    _run(eng, {"s": (PREFIX[:13], one)}, salt="tenant")
    evs = eng.drain_kv_events()
    # what a router computes from the worker's registered fingerprint and the tokens
    plain = block_hashes(PREFIX[:12], BS, chain_root(eng.layout.fingerprint()))
    salted = block_hashes(PREFIX[:12], BS, chain_root(eng.layout.fingerprint(), "", "tenant"))
    assert [(type(e), e.block_hashes, e.parent) for e in evs] == [
        (BlocksStored, tuple(plain), None), (BlocksStored, tuple(salted), None)]
    assert [e.seq for e in evs] == [1, 2] and eng.drain_kv_events() == []
    assert eng.cached_prefix_blocks(PREFIX[:13]) == 3
    assert eng.cached_prefix_blocks(PREFIX[:13], cache_salt="tenant") == 3
    assert eng.cached_prefix_blocks(PREFIX[:13], cache_salt="other") == 0
    assert eng.cached_prefix_blocks(PREFIX[:2] + PREFIX[4:13]) == 0
    snap = eng.kv_cache_snapshot()
    assert snap.seq == 2 and {h for h, _ in snap.blocks} == set(plain) | set(salted)
    _run(eng, {"big": (list(range(100, 163)), one)})  # 16 blocks: evicts all 6
    evs = eng.drain_kv_events()
    removed = [h for e in evs if isinstance(e, BlocksRemoved) for h in e.block_hashes]
    assert set(removed) == set(plain) | set(salted) and evs[0].seq == 3
    _pool_whole(eng)


def test_consumer_reservation_reuses_cached_leading_blocks(tiny_models, make_llm):
    """A consumer holding a prompt's blocks reserves them again instead of fresh ones (the
    sender would skip them), all but the one holding the last token (which always moves),
    and decoding on top of them gives the colocated tokens."""
    eng = make_llm(tiny_models["llama"], block_size=BS, role="consumer").engine
    prompt = PREFIX[:16]
    params = SamplingParams(max_tokens=6, temperature=0.7, seed=9, ignore_eos=True)
    ref = _run(eng, {"local": (prompt, params)})["local"][0]  # e.g. a recompute, earlier
    assert eng.cached_prefix_blocks(prompt) == 4
    cached = eng.blocks.match(block_hashes(prompt, BS, chain_root(eng.prefix_model_key)))
    eng.add_remote("fresh", prompt, params)  # today's protocol: every block is written
    eng.add_remote("reuse", prompt, params, reuse_cached=True)
    res = eng.step()
    assert res.reserved["reuse"][:3] == cached[:3] and res.reserved_cached == {"reuse": 3}
    assert res.reserved["reuse"][3] not in cached
    assert not set(res.reserved["fresh"]) & set(cached)
    # the transfer of the one block not reused: the same KV, from where "local" left it
    eng.kv_cache[res.reserved["reuse"][3]] = eng.kv_cache[cached[3]]
    cached = cached[:3]
    eng.abort("fresh")  # WAITING_FOR_KV
    eng.add_remote("queued", prompt, params, reuse_cached=True)
    eng.abort("queued")  # RESERVING: held nothing yet
    eng.add_remote("gone", prompt, params, reuse_cached=True)
    assert eng.step().reserved_cached == {"gone": 3}
    assert all(eng.blocks.refcount(b) == 2 for b in cached)  # "reuse" and "gone"
    eng.abort("gone")  # WAITING_FOR_KV holding shared cached blocks: one reference goes
    assert all(eng.blocks.refcount(b) == 1 for b in cached)
    eng.kv_landed("reuse", ref[0])  # 12 prompt tokens' KV were already there
    tokens = [ref[0]]
    outs: list[RequestOutput] = []
    while eng.has_unfinished():
        outs += eng.step().outputs
    tokens += [t for o in outs for t in o.new_token_ids]
    assert tokens == ref and outs[-1].num_cached_tokens == 12
    stats = eng.prefix_cache_stats()
    # "local" missed, "reuse" and "gone" hit 12 of 16; "fresh" asked nothing
    assert (stats.queried_tokens, stats.hit_tokens) == (16 * 3, 0 + 12 * 2)
    eng.release("fresh")
    _pool_whole(eng)


def test_producer_pins_cached_blocks_and_releases_them(tiny_models, make_llm):
    """A producer's request that hit the cache reports the hit blocks final at once and may
    pin them; preemption or abort leaves the pins, release frees them."""
    eng = make_llm(tiny_models["llama"], block_size=BS, role="producer").engine
    _run(eng, {"warm": (PREFIX, GREEDY)})
    for rid in eng.held_requests():
        eng.release(rid.request_id)  # TRANSFERRING until the consumer's ack
    eng.add_request("p", PREFIX + [5, 6], GREEDY)
    res = eng.step()
    assert res.final_blocks["p"] == 7 and eng.state_of("p") == RequestState.TRANSFERRING
    pinned = eng.pin("p", 0, 7)
    assert all(eng.blocks.refcount(b) == 2 for b in pinned)
    eng.abort("p")  # the transfer may still read them
    assert all(eng.blocks.refcount(b) == 1 for b in pinned)
    eng.release("p")
    _pool_whole(eng)


def test_the_flag_reaches_the_engine_config():
    p = argparse.ArgumentParser()
    add_engine_args(p)
    assert engine_config(p.parse_args([])).enable_prefix_caching
    assert not engine_config(p.parse_args(["--no-enable-prefix-caching"])).enable_prefix_caching
    with pytest.raises(ValueError, match="^enable_prefix_caching: "):
        EngineConfig(enable_prefix_caching="yes")  # type: ignore[arg-type]


def test_a_salt_must_be_a_string(tiny_models, make_llm):
    eng = make_llm(tiny_models["llama"], block_size=BS).engine
    with pytest.raises(ValueError, match="^cache_salt: "):
        eng.add_request("r", PREFIX, GREEDY, cache_salt=7)  # type: ignore[arg-type]
    assert not eng.requests


def test_tensor_parallel_ranks_follow_rank_0s_hits(tiny_models):
    """Rank 0 decides which blocks hold what; the follower runs the same block tables, so a
    hit on it reads the KV its own shard cached (same tokens as TP1 without the cache)."""
    from engine.llm import LLM

    path = tiny_models["llama"]  # 2 KV heads: one per rank
    waves = [[PREFIX + [1, 2, 3], PROMPTS[2]], [PREFIX + [4], PREFIX[:16], PROMPTS[2] + [5]]]
    runs = []
    for kw in ({"enable_prefix_caching": False}, {"tensor_parallel_size": 2}):
        with LLM(path, block_size=BS, max_num_batched_tokens=16, **kw) as llm:
            runs.append([[c.token_ids for c in llm.generate(w, SEEDED)] for w in waves])
            if "tensor_parallel_size" in kw:
                assert llm.engine.prefix_cache_stats().hit_tokens == 24 + 12 + 48
                _pool_whole(llm.engine)
    assert runs[0] == runs[1]
