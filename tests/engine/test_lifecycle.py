"""The request lifecycle is executable: every documented edge is accepted, every other one
refused, every state is reached by the engine's own code, and a finished request's blocks
return to the pool only after the last launched step that may write them was read."""

from __future__ import annotations

import itertools

import pytest
from tiny_models import PROMPTS

from engine.request import Request
from engine.request_state import EDGES, BadTransition, RequestState, check_transition
from engine.sampling_params import SamplingParams

S = RequestState
GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)


def test_every_documented_edge_is_accepted_and_every_other_refused():
    for old, new in itertools.product(S, S):
        if (old, new) in EDGES:
            check_transition(old, new)
        else:
            with pytest.raises(BadTransition, match=f"{old.name} -> {new.name}"):
                check_transition(old, new)


def test_the_diagram_has_the_backward_edges_and_finished_is_final():
    assert (S.DECODING, S.QUEUED) in EDGES and (S.PREFILLING, S.QUEUED) in EDGES  # preempt
    # a retry or a migration is a new request on other workers (the router's RunPhase),
    # never a worker-side edge: a worker accepts no QUEUED -> RESERVING or back to RESERVING
    assert not [e for e in EDGES if e[1] is S.RESERVING]
    assert (S.QUEUED, S.TRANSFERRING) not in EDGES
    assert not [e for e in EDGES if e[0].finished]
    for s in S:
        if not s.finished:
            assert (s, S.FINISHED_ABORTED) in EDGES and (s, S.FINISHED_ERROR) in EDGES


def test_request_move_refuses_an_undocumented_edge():
    r = Request("r", [1, 2], SamplingParams(), seed=0)
    r.move(S.PREFILLING)
    with pytest.raises(BadTransition):
        r.move(S.WAITING_FOR_KV)
    assert r.state == S.PREFILLING


def _run(engine, rid=None):  # type: ignore[no-untyped-def]
    outs = []
    while engine.has_unfinished():
        outs += [o for o in engine.step().outputs if rid is None or o.request_id == rid]
    return outs


def test_every_state_is_reached_by_engine_code(tiny_models, make_llm, monkeypatch):
    seen: set[RequestState] = set()
    move = Request.move

    def recording(self: Request, new: RequestState) -> None:
        seen.add(self.state)
        move(self, new)
        seen.add(new)

    monkeypatch.setattr(Request, "move", recording)
    path = tiny_models["llama"]
    prod = make_llm(path, block_size=4, role="producer").engine
    cons = make_llm(path, block_size=4, role="consumer").engine
    prompt = PROMPTS[0]
    # producer: QUEUED -> PREFILLING -> TRANSFERRING, then released
    prod.add_request("p", prompt, GREEDY)
    (t0,) = _run(prod)
    assert t0.state == S.TRANSFERRING
    # consumer: RESERVING -> WAITING_FOR_KV -> DECODING -> FINISHED_LENGTH
    cons.add_remote("p", prompt, GREEDY)
    res = cons.step()
    dst = res.reserved["p"]
    assert cons.state_of("p") == S.WAITING_FOR_KV
    src = prod.pin("p", 0, len(dst))
    cons.kv_cache[dst] = prod.kv_cache[src]
    prod.release("p")
    cons.kv_landed("p", t0.new_token_ids[0])
    assert _run(cons)[-1].state == S.FINISHED_LENGTH
    # a stop token, an abort, a failed transfer
    stop = SamplingParams(max_tokens=8, temperature=0, stop_token_ids=[t0.new_token_ids[0]])
    prod.add_request("s", prompt, stop)
    assert _run(prod)[-1].state == S.FINISHED_STOPPED
    cons.add_remote("a", prompt, GREEDY)
    cons.add_remote("e", prompt, GREEDY)
    cons.step()
    cons.abort("a")
    cons.abort("e", S.FINISHED_ERROR)
    assert cons.state_of("a") is None and cons.state_of("e") is None
    # preemption: back to QUEUED
    small = make_llm(path, block_size=4, num_kv_blocks=8).engine
    for i in range(3):
        small.add_request(f"x{i}", PROMPTS[1], SamplingParams(max_tokens=10, ignore_eos=True))
    _run(small)
    assert small.num_preemptions > 0
    assert seen == set(S), set(S) - seen


def test_a_finished_request_keeps_its_blocks_until_the_step_writing_them_is_read(
        tiny_models, make_llm):
    # Deferred output: step N+1 (writing r's next KV slot) is launched before step N's
    # token is read. r stopping at N must not free its blocks while N+1 may write them: a
    # reservation could hand them to a transfer that lands out of order on a GPU.
    path = tiny_models["llama"]
    ref = make_llm(path, block_size=4).generate([PROMPTS[1]], GREEDY)[0].token_ids
    i = next(i for i in range(1, len(ref)) if ref[i] not in ref[:i])
    eng = make_llm(path, block_size=4).engine
    assert eng.defers_output
    eng.add_request("r", PROMPTS[1], SamplingParams(max_tokens=8, temperature=0,
                                                    ignore_eos=True, stop_token_ids=[ref[i]]))
    done = []
    while not done:
        done = [o for o in eng.step().outputs if o.finished]
        assert eng.has_unfinished()
    assert done[0].finish_reason == "stop"
    held = eng.block_accounting().used
    assert held == eng.blocks.blocks_for(len(PROMPTS[1]) + i + 2) > 0  # not freed yet
    assert eng.state_of("r") is None  # finished and forgotten; only its blocks wait
    eng.step()  # reads the step launched with r in it
    assert eng.block_accounting().used == 0
    assert not eng.has_unfinished()


def test_an_abort_between_steps_waits_for_the_launched_step(tiny_models, make_llm):
    eng = make_llm(tiny_models["llama"], block_size=4).engine
    eng.add_request("r", PROMPTS[0], GREEDY)
    eng.step()
    eng.step()  # step 2 (r's first decode) is launched and not read
    used = eng.block_accounting().used
    assert eng.abort("r")
    assert eng.block_accounting().used == used  # step 2 may still write r's blocks
    assert eng.step().outputs == []  # reads step 2; r's token is dropped
    assert eng.block_accounting().used == 0


def test_a_producer_abort_keeps_pinned_blocks_until_release(tiny_models, make_llm):
    eng = make_llm(tiny_models["llama"], block_size=4, role="producer",
                   max_num_batched_tokens=16).engine
    eng.add_request("p", PROMPTS[2], GREEDY)
    res = eng.step()
    assert res.final_blocks == {"p": 4}
    pinned = eng.pin("p", 0, 4)
    eng.abort("p")
    assert eng.state_of("p") == S.FINISHED_ABORTED  # kept: a transfer may read the pins
    assert eng.block_accounting().used == 4
    assert sorted(h.blocks for h in eng.held_requests()) == [4]
    eng.release("p")
    assert eng.block_accounting().used == 0 and eng.state_of("p") is None
    assert len(pinned) == 4
