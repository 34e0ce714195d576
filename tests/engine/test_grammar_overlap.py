"""When the grammar masks are built, relative to the forward they must hide behind.

The engine thread launches a step's forward before it does any mask work for that step
(reading the previous step's ids, advancing matchers, filling rows) or waits for the mask
thread's job; the job (``GrammarMasks.ahead``) runs on its own thread and makes the same
masks, bit for bit, as the in-step path. A seam records the order of calls: moving the mask
work in front of the forward's launch, or onto the engine thread's path before it, fails.
"""

from __future__ import annotations

import importlib.util
import json
import threading
from typing import Any

import pytest
import torch
from tiny_models import byte_tokenizer, make_tiny_model

import engine.model_runner as model_runner
from engine.grammar.masks import GrammarMasks
from engine.grammar.matcher import RequestGrammar
from engine.request import PLACEHOLDER, Request
from engine.sampling_params import SamplingParams

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 6},
    "n": {"type": "integer", "minimum": 0, "maximum": 99},
    "tags": {"type": "array", "items": {"enum": ["x", "y"]}, "maxItems": 2}},
    "required": ["name", "n", "tags"], "additionalProperties": False,
    "x-guidance": {"whitespace_flexible": False}}
SPEC = {"kind": "json_schema", "value": json.dumps(SCHEMA)}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from engine.llm import LLM

    path = str(tmp_path_factory.mktemp("tiny_grammar_overlap"))
    make_tiny_model(path, "llama")
    byte_tokenizer(path)
    llm = LLM(path, max_num_seqs=8, max_num_batched_tokens=256)
    yield llm
    llm.engine.runner.grammar_masks.ahead_enabled = False


def _params(n: int) -> list[SamplingParams]:
    return [SamplingParams(max_tokens=60, temperature=1.0, seed=i, structured=SPEC)
            for i in range(n)]


class _Seam:
    """Records, in call order, each step's start, its forward's launch (eager, or the static
    decode buffers' replay) and the mask work, with the thread each ran on."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, runner: Any) -> None:
        self.log: list[tuple[str, str]] = []
        masks: GrammarMasks = runner.grammar_masks
        run_plan, execute = model_runner.run_plan, runner.execute
        fill, join, accept = masks._fill, masks._join, RequestGrammar.accept
        seam = self

        def step(*a: Any, **k: Any) -> Any:
            seam.note("step")
            return execute(*a, **k)

        def forward(*a: Any, **k: Any) -> Any:
            seam.note("forward")
            return run_plan(*a, **k)

        def mask(*a: Any, **k: Any) -> Any:
            seam.note("mask")
            return fill(*a, **k)

        def wait(*a: Any, **k: Any) -> Any:
            if masks._job is not None:
                seam.note("join")
            return join(*a, **k)

        def advance(g: RequestGrammar, t: int) -> bool:
            seam.note("advance")
            return accept(g, t)

        monkeypatch.setattr(runner, "execute", step)
        monkeypatch.setattr(model_runner, "run_plan", forward)  # eager steps
        if runner.graphs is not None:  # pure-decode steps (CUDA graphs, or their eager twin)
            replay = runner.graphs.replay

            def forward_static(*a: Any, **k: Any) -> Any:
                seam.note("forward")
                return replay(*a, **k)
            monkeypatch.setattr(runner.graphs, "replay", forward_static)
        monkeypatch.setattr(masks, "_fill", mask)
        monkeypatch.setattr(masks, "_join", wait)
        monkeypatch.setattr(RequestGrammar, "accept", advance)

    def note(self, what: str) -> None:
        self.log.append((what, threading.current_thread().name))

    def steps(self) -> list[list[str]]:
        """The engine thread's events, one list per step; fails where a step did mask
        work (or waited for the mask thread) before launching its forward."""
        out: list[list[str]] = []
        for what, thread in self.log:
            if thread != threading.main_thread().name:
                continue
            if what == "step":
                out.append([])
                continue
            assert out, f"{what} outside a step"
            assert what == "forward" or "forward" in out[-1], \
                f"{what} before the step's forward was launched: {out[-1]}"
            out[-1].append(what)
        return out


def _run(llm, params: list[SamplingParams]) -> list[list[int]]:
    prompts = [[5 + i, 17, 33, 90][: 2 + i % 3] for i in range(len(params))]
    return [r.token_ids for r in llm.generate(prompts, params)]


def test_in_step_masks_come_after_the_forward_launch(tiny, monkeypatch) -> None:
    masks = tiny.engine.runner.grammar_masks
    masks.ahead_enabled = False
    seam = _Seam(monkeypatch, tiny.engine.runner)
    outs = _run(tiny, _params(5))
    assert all(len(o) > 3 for o in outs)
    steps = seam.steps()
    with_masks = [s for s in steps if "mask" in s and "advance" in s]
    assert len(with_masks) > 5  # decode steps built masks, each after its forward
    assert all("join" not in s for s in steps)
    assert all(t == threading.main_thread().name for _, t in seam.log)


def test_ahead_masks_run_on_the_mask_thread_and_give_the_same_tokens(tiny,
                                                                     monkeypatch) -> None:
    masks = tiny.engine.runner.grammar_masks
    masks.ahead_enabled = False
    want = _run(tiny, _params(6))
    masks.ahead_enabled = True
    seam = _Seam(monkeypatch, tiny.engine.runner)
    ahead0 = masks.rows_ahead
    got = _run(tiny, _params(6))
    assert got == want
    assert masks.rows_ahead - ahead0 > 20
    off_thread = [w for w, t in seam.log if t.startswith("grammar-masks")]
    assert "mask" in off_thread and "advance" in off_thread
    steps = seam.steps()
    assert len([s for s in steps if "join" in s]) > 5  # each after the step's forward


def _grammar(llm) -> RequestGrammar:
    g = llm.engine.grammars.for_params(SamplingParams(structured=SPEC))
    assert g is not None
    return g


def test_ahead_rows_equal_in_step_rows(tiny) -> None:
    """Three requests (grammar, none, grammar), one of them fed a token its grammar
    rejects: the ahead job's masks and the in-step path's are the same bits, rows without
    a grammar are all ones and the rejected one allows EOS alone."""
    eos = sorted(tiny.engine.eos_token_ids)
    vocab = tiny.engine.runner.vocab
    opening = tiny.tokenizer.encode('{"name":"', add_special_tokens=False)

    def batch() -> list[Request]:
        reqs = [Request(f"r{i}", [1, 2], SamplingParams(), seed=i,
                        output_token_ids=list(opening)) for i in range(3)]
        reqs[0].grammar, reqs[2].grammar = _grammar(tiny), _grammar(tiny)
        return reqs

    ahead = GrammarMasks(vocab, eos, torch.device("cpu"), ahead=True)
    step = GrammarMasks(vocab, eos, torch.device("cpu"), ahead=False)
    a, s = batch(), batch()
    first_a, first_s = ahead.bitmask(a, None), step.bitmask(s, None)
    assert first_a is not None and first_s is not None
    assert torch.equal(first_a, first_s)
    assert (first_a[1] == -1).all()
    enc = tiny.tokenizer.encode
    # 'a' continues the string; a raw newline may not appear in a JSON string: rejected
    sampled = torch.tensor([enc("a", add_special_tokens=False)[0], 0,
                            enc("\n", add_special_tokens=False)[0]])
    for m, reqs in ((ahead, a), (step, s)):
        m.ahead(reqs, sampled)
        for r in reqs:
            r.output_token_ids.append(PLACEHOLDER)
    ids = dict(zip((id(r) for r in a + s), sampled.tolist() * 2, strict=True))
    got = ahead.bitmask(a, lambda r: ids[id(r)])
    want = step.bitmask(s, lambda r: ids[id(r)])
    assert got is not None and want is not None
    assert ahead.rows_ahead == 2 and step.rows_ahead == 0
    assert torch.equal(got, want)
    assert (got[1] == -1).all()
    bits = ((got[2].to(torch.int64).unsqueeze(-1) >> torch.arange(32)) & 1).flatten()[:vocab]
    assert bits.nonzero().flatten().tolist() == eos
    assert a[2].grammar is not None and a[2].grammar.failed
    assert got[0].ne(0).any() and got[0].ne(-1).any()  # a real grammar row: some, not all
    ahead.close()
    step.close()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.skipif(importlib.util.find_spec("llguidance") is None,
                    reason="needs llguidance (the GPU machine lacks it unless carried)")
@pytest.mark.parametrize("seeded", [False, True], ids=["greedy", "seeded"])
def test_on_the_gpu_ahead_masks_give_the_in_step_tokens(make_llm, tiny_models, tmp_path,
                                                       monkeypatch, seeded: bool) -> None:
    """CUDA graphs, deferred output: the ahead job (on by default on CUDA) covers the decode
    rows, the engine thread meets it only after each step's forward was launched, and the
    tokens equal the in-step path's."""
    import shutil

    path = str(tmp_path / "llama")
    shutil.copytree(tiny_models["llama"], path)
    byte_tokenizer(path)
    params = [SamplingParams(max_tokens=60, structured=SPEC,
                             **(dict(temperature=1.0, seed=i) if seeded
                                else dict(temperature=0.0)))
              for i in range(9)]
    prompts = [[5 + i, 17, 33, 90, 12][: 2 + i % 4] for i in range(9)]
    kw = dict(device="cuda", dtype="float32", max_num_seqs=16, max_model_len=256)
    llm = make_llm(path, **kw)
    masks = llm.engine.runner.grammar_masks
    assert masks.ahead_enabled and llm.engine.runner.graphs is not None
    masks.ahead_enabled = False
    want = [r.token_ids for r in llm.generate(prompts, params)]
    masks.ahead_enabled = True
    seam = _Seam(monkeypatch, llm.engine.runner)
    ahead0, in_step0 = masks.rows_ahead, masks.rows_in_step
    got = [r.token_ids for r in llm.generate(prompts, params)]
    assert got == want
    # token 0's rows are made in the step, every later one by the job
    assert masks.rows_ahead - ahead0 > 3 * (masks.rows_in_step - in_step0)
    assert len([s for s in seam.steps() if "join" in s]) > 10


def test_wait_lets_the_ahead_job_finish_and_keeps_its_rows(tiny, monkeypatch) -> None:
    """Code outside a step that reads a grammar (a benchmark's error check) calls wait()
    first: it returns only once the mask thread is done with the matchers (llguidance
    refuses a matcher used from two threads), and the next step still uses the job's rows."""
    eos = sorted(tiny.engine.eos_token_ids)
    opening = tiny.tokenizer.encode('{"name":"', add_special_tokens=False)
    reqs = [Request(f"w{i}", [1, 2], SamplingParams(), seed=i, output_token_ids=list(opening))
            for i in range(2)]
    for r in reqs:
        r.grammar = _grammar(tiny)
    masks = GrammarMasks(tiny.engine.runner.vocab, eos, torch.device("cpu"), ahead=True)
    assert masks.bitmask(reqs, None) is not None
    go, accept = threading.Event(), RequestGrammar.accept

    def held(g: RequestGrammar, t: int) -> bool:
        assert go.wait(10)
        return accept(g, t)

    monkeypatch.setattr(RequestGrammar, "accept", held)
    a = tiny.tokenizer.encode("a", add_special_tokens=False)[0]
    masks.ahead(reqs, torch.tensor([a, a]))
    for r in reqs:
        r.output_token_ids.append(a)
    waiter = threading.Thread(target=masks.wait)
    waiter.start()
    waiter.join(0.3)
    assert waiter.is_alive()  # the job still holds the matchers
    go.set()
    waiter.join(10)
    assert not waiter.is_alive()
    assert all(r.grammar is not None and r.grammar.num_accepted == len(opening) + 1
               and not r.grammar.failed for r in reqs)
    assert masks.bitmask(reqs, None) is not None
    assert masks.rows_ahead == 2 and masks.rows_in_step == 2  # the first call's, then the job's
    masks.close()
