"""Pure-decode steps under tensor parallelism go through the decode graphs' buffers on every
rank (engine.parallel.graph_step): on CPU the same buffers run eagerly with gloo, so the
protocol (staged rows, table edits, the head's sampling on every rank, the eager sampler's
broadcast, the previous step's ids copied in) is checked here; the CUDA capture on GPU."""

from __future__ import annotations

import os

import pytest
from tiny_models import PROMPTS, make_tiny_model

from engine.llm import LLM
from engine.parallel.graph_step import GraphStep
from engine.sampling_params import SamplingParams

# greedy and temperature-only rows sample in the head graph; top-k and penalties eagerly
MIXED = [SamplingParams(max_tokens=10, temperature=0, ignore_eos=True),
         SamplingParams(max_tokens=10, temperature=0.8, seed=11, ignore_eos=True),
         SamplingParams(max_tokens=10, temperature=1.0, top_k=7, seed=3, ignore_eos=True),
         SamplingParams(max_tokens=10, temperature=1.1, repetition_penalty=1.3, seed=9,
                        ignore_eos=True)]
PLAIN = [SamplingParams(max_tokens=10, temperature=0, ignore_eos=True),
         SamplingParams(max_tokens=10, temperature=0.9, seed=4, ignore_eos=True)]


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> str:
    return make_tiny_model(os.path.join(tmp_path_factory.mktemp("tpg"), "m"), "llama",
                           seed=3, num_key_value_heads=2)


def _run(path: str, rounds: list[list[SamplingParams]], **kw: object):
    sent: list[GraphStep] = []
    with LLM(path, block_size=4, max_num_batched_tokens=16, max_num_seqs=8,
             max_model_len=128, **kw) as llm:
        f = llm.engine.runner.followers
        if f is not None:
            send = f.send

            def spy(msg: object) -> None:
                if isinstance(msg, GraphStep):
                    sent.append(msg)
                send(msg)
            f.send = spy  # type: ignore[method-assign]
        outs = []
        for params in rounds:
            n = len(params)
            outs.append([c.token_ids for c in llm.generate(PROMPTS[:n], params)])
    return outs, sent


def test_tp2_decode_steps_replay_the_buffers_on_every_rank_and_equal_tp1(model):
    rounds = [PLAIN, MIXED, PLAIN[:1]]
    tp1, _ = _run(model, rounds)
    tp2, sent = _run(model, rounds, tensor_parallel_size=2)
    assert tp2 == tp1
    assert any(s.head for s in sent)  # the all-simple rounds sampled in the head
    assert any(s.samples and not s.head for s in sent)  # the mixed round eagerly
    assert any(s.copy_prev for s in sent)  # after an eager (prefill) step's broadcast ids
    assert any(len(s.edit_at) for s in sent)  # block tables travel as edits
    assert all(s.ints.shape == (7, s.padded) for s in sent)


@pytest.mark.gpu
def test_gpu_tp2_captures_the_graphs_with_the_collectives_and_equals_tp1(model):
    import torch

    if torch.cuda.device_count() < 2:
        pytest.skip("needs two CUDA devices")
    kw = dict(device="cuda", dtype="float32")
    rounds = [PLAIN, MIXED]
    eager, _ = _run(model, rounds, enforce_eager=True, **kw)
    tp1, _ = _run(model, rounds, **kw)
    with LLM(model, block_size=4, max_num_seqs=8, max_model_len=128,
             tensor_parallel_size=2, **kw) as llm:
        g = llm.engine.runner.graphs
        assert g is not None and g.use_graphs
        tp2 = [[c.token_ids for c in llm.generate(PROMPTS[:len(p)], p)] for p in rounds]
        assert g.num_replays > 0 and g.num_head_replays > 0
    assert tp2 == tp1 == eager
