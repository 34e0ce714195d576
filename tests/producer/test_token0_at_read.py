"""A producer's token 0s leave from the engine's read-back (``LLMEngine.on_read``): emitted
and sent before the step's result is built and before the worker loop's own bookkeeping,
since every client of the step waits for the last of its token 0s (bench/RESULTS.md,
session 43). The transfer then goes on as before: the same tokens, every block back."""

from __future__ import annotations

from role_harness import PD
from tiny_models import PROMPTS

from engine.llm import LLM
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams
from worker.messages import Token0Event

GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)


def _flushes_in_a_pd_run(tiny_llama, monkeypatch, **producer_kw):  # type: ignore[no-untyped-def]
    """Serves three requests through a producer (its engine made with producer_kw) and a
    consumer; returns, for each flush of the producer's events, whether it came inside
    engine.step() and whether that step's result was built by then. Asserts the tokens
    are greedy's and every block comes back."""
    pd = PD(tiny_llama, producer_kw=producer_kw)
    now = {"in_step": False, "result": False}
    flushes: list[tuple[bool, bool]] = []  # (inside engine.step, its result built) at each
    step, result = LLMEngine.step, LLMEngine._result

    def stepping(self):  # type: ignore[no-untyped-def]
        now.update(in_step=True, result=False)
        try:
            return step(self)
        finally:
            now["in_step"] = False

    def building(self, *a, **kw):  # type: ignore[no-untyped-def]
        now["result"] = True
        return result(self, *a, **kw)

    monkeypatch.setattr(LLMEngine, "step", stepping)
    monkeypatch.setattr(LLMEngine, "_result", building)
    pd.producer.flush_events = lambda: flushes.append((now["in_step"], now["result"]))
    rids = [f"r{i}" for i in range(3)]
    for rid, prompt in zip(rids, PROMPTS, strict=False):
        pd.submit(rid, prompt, GREEDY)
    pd.run(lambda: all(pd.p.of(r, Token0Event) for r in rids))
    pd.run(lambda: all(pd.finished(r) for r in rids))
    ref = LLM(tiny_llama, block_size=4).generate(
        [PROMPTS[i] for i in range(len(rids))], GREEDY)
    assert [pd.tokens(r) for r in rids] == [o.token_ids for o in ref]
    pd.run(lambda: pd.p.whole() and pd.c.whole())
    return flushes


def test_token0s_are_sent_before_the_step_result(tiny_llama, monkeypatch):  # type: ignore[no-untyped-def]
    flushes = _flushes_in_a_pd_run(tiny_llama, monkeypatch)
    # sent from inside the step that sampled them, before its result was built (on the loop's
    # turn after engine.step() returned, as before, it would be (False, True))
    assert flushes and all(f == (True, False) for f in flushes), flushes


def test_a_deferring_producer_still_sends_every_token0(tiny_llama, monkeypatch):  # type: ignore[no-untyped-def]
    """A producer made to defer (defer_output, a benchmark's comparison) reads each step
    during the next one, where the engine calls no hook: its token 0s leave from
    on_outputs, after engine.step() returned, and the requests finish as before. Until
    session 44 such a producer pushed all but the partial last block of each prompt (the
    engine counted the final blocks only for the step's chunks, before token 0 was read),
    and the consumer decoded from a hole: tokens from the second or third on differed."""
    flushes = _flushes_in_a_pd_run(tiny_llama, monkeypatch, defer_output=True)
    assert flushes and all(f == (False, True) for f in flushes), flushes
