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


def test_token0s_are_sent_before_the_step_result(tiny_llama, monkeypatch):  # type: ignore[no-untyped-def]
    pd = PD(tiny_llama)
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
    # sent from inside the step that sampled them, before its result was built (on the loop's
    # turn after engine.step() returned, as before, it would be (False, True))
    assert flushes and all(f == (True, False) for f in flushes), flushes
    pd.run(lambda: all(pd.finished(r) for r in rids))
    ref = LLM(tiny_llama, block_size=4).generate(
        [PROMPTS[i] for i in range(len(rids))], GREEDY)
    assert [pd.tokens(r) for r in rids] == [o.token_ids for o in ref]
    pd.run(lambda: pd.p.whole() and pd.c.whole())
