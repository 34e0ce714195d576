"""Data-parallel attention with expert-parallel MoE layers (engine/parallel/dp_groups.py), on
CPU over gloo: tiny DeepSeek-V3 (MLA + MoE) and Qwen3-MoE models saved by transformers.
Greedy tokens equal the single-rank engine's with requests spread over the attention groups
and with every request on one group (the other group idle, running zero-token steps); each
group is its own scheduling slot; a dying rank fails the engine without hanging."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest
import torch
from tiny_deepseek import MODELS as DS_MODELS
from tiny_deepseek import make_tiny_deepseek
from tiny_models import PROMPTS, make_tiny_model

from engine.llm import LLM
from engine.parallel.followers import TPRankError
from engine.sampling_params import SamplingParams

GREEDY = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
# budget 16: prompts prefill in chunks mixed with the other requests' decodes
KW = dict(block_size=4, max_num_batched_tokens=16)


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("dpa")
    v, kw = DS_MODELS["v3"]
    return {"v3": make_tiny_deepseek(os.path.join(root, "v3"), v, seed=3, **kw),
            "qwen3_moe": make_tiny_model(os.path.join(root, "qwen3_moe"), "qwen3_moe",
                                         seed=4),
            "llama": make_tiny_model(os.path.join(root, "llama"), "llama", seed=5)}


_REF: dict[str, list[list[int]]] = {}


def _reference(path: str) -> list[list[int]]:
    if path not in _REF:
        with LLM(path, **KW) as llm:
            _REF[path] = [c.token_ids for c in llm.generate(PROMPTS, GREEDY)]
    return _REF[path]


@pytest.mark.parametrize("name", ["v3", "qwen3_moe"])
def test_dpa_tp2_equals_one_rank_spread_and_on_one_group(models, name):
    path = models[name]
    want = _reference(path)
    with LLM(path, tensor_parallel_size=2, data_parallel_size=2, **KW) as llm:
        eng = llm.engine
        placed: list[int] = []
        orig = eng.scheduler.place  # type: ignore[union-attr]

        def spy(req, dp_rank):  # type: ignore[no-untyped-def]
            orig(req, dp_rank)
            placed.append(req.dp_rank)

        eng.scheduler.place = spy  # type: ignore[union-attr]
        spread = [c.token_ids for c in llm.generate(PROMPTS, GREEDY)]
        assert sorted(set(placed)) == [0, 1], placed  # least loaded: both groups got some
        assert spread == want
        for g in (0, 1):  # only group g has work; the other joins every step with no tokens
            placed.clear()
            got = [c.token_ids for c in llm.generate(PROMPTS, GREEDY,
                                                     dp_ranks=[g] * len(PROMPTS))]
            assert placed == [g] * len(PROMPTS)
            assert got == want, g
        # a request arriving on an idle group while the other decodes
        mixed = [c.token_ids for c in llm.generate(PROMPTS, GREEDY, dp_ranks=[1, 0, 0, 0])]
        assert mixed == want


def test_four_ranks_two_attention_groups_of_two(models):
    """T=4, D=2: attention tensor-parallel inside each group of two, experts over all four."""
    path = models["v3"]
    want = _reference(path)
    with LLM(path, tensor_parallel_size=4, data_parallel_size=2, **KW) as llm:
        assert [c.token_ids for c in llm.generate(PROMPTS, GREEDY)] == want
        assert [c.token_ids for c in llm.generate(PROMPTS, GREEDY,
                                                  dp_ranks=[1] * len(PROMPTS))] == want


def test_each_group_is_its_own_slot(models):
    """Own queues and pool: requests placed on group 1 hold group 1's blocks only, and the
    load of each group is reported apart; a tight pool preempts in its own group only."""
    path = models["qwen3_moe"]
    want = _reference(path)
    with LLM(path, tensor_parallel_size=2, data_parallel_size=2, num_kv_blocks=24,
             **KW) as llm:
        eng = llm.engine
        loads = eng.scheduler.loads()
        assert [ld["kv_blocks_total"] for ld in loads] == [24, 24]
        for i, p in enumerate(PROMPTS):
            eng.add_request(f"r{i}", p, GREEDY, dp_rank=1)
        loads = eng.scheduler.loads()
        assert (loads[0]["waiting"], loads[1]["waiting"]) == (0, len(PROMPTS))
        eng.step()
        loads = eng.scheduler.loads()
        assert loads[0]["kv_blocks_free"] == 24 and loads[1]["kv_blocks_free"] < 24
        assert loads[1]["running"] >= 1 and loads[0]["running"] == 0
        acc = eng.block_accounting()
        assert acc.total == 48 and acc.free == 24 + loads[1]["kv_blocks_free"]
        got: dict[str, list[int]] = {}
        while eng.has_unfinished():
            for o in eng.step().outputs:
                got.setdefault(o.request_id, []).extend(o.new_token_ids)
        assert [got[f"r{i}"] for i in range(len(PROMPTS))] == want
        assert eng.num_preemptions > 0  # 4 requests of up to ~40 tokens in 24 blocks of 4
        assert eng.scheduler.loads()[1]["kv_blocks_free"] == 24  # every block came back


def test_seeded_sampling_is_the_same_on_any_group(models):
    path = models["v3"]
    params = SamplingParams(max_tokens=8, temperature=0.9, top_k=20, seed=7, ignore_eos=True)
    with LLM(path, **KW) as llm:
        want = [c.token_ids for c in llm.generate(PROMPTS, params)]
    with LLM(path, tensor_parallel_size=2, data_parallel_size=2, **KW) as llm:
        assert [c.token_ids for c in llm.generate(PROMPTS, params)] == want
        assert [c.token_ids for c in llm.generate(PROMPTS, params,
                                                  dp_ranks=[1, 1, 0, 1])] == want


def test_bad_layouts_and_placements_are_refused_by_name(models):
    with pytest.raises(ValueError, match="data_parallel_size"):
        LLM(models["v3"], tensor_parallel_size=2, data_parallel_size=3)
    with pytest.raises(ValueError, match="--data-parallel-size.*mixture-of-experts"):
        LLM(models["llama"], tensor_parallel_size=2, data_parallel_size=2)
    with LLM(models["qwen3_moe"], tensor_parallel_size=2, data_parallel_size=2, **KW) as llm:
        with pytest.raises(ValueError, match="dp_rank"):
            llm.engine.add_request("x", [1, 2, 3], GREEDY, dp_rank=2)
        # the engine keeps serving
        assert len(llm.generate([[1, 2, 3]], GREEDY)[0].token_ids) == GREEDY.max_tokens
    with LLM(models["qwen3_moe"], **KW) as llm, pytest.raises(ValueError, match="dp_rank"):
        llm.engine.add_request("x", [1, 2, 3], GREEDY, dp_rank=1)


def test_a_dying_rank_fails_the_engine_without_hanging(models):
    """Rank 1 (group 1) dies while only group 0 has requests: rank 0's next exchange fails,
    the engine reports the rank, stops every rank and stays failed."""
    _kill_rank_1_mid_generate(models["qwen3_moe"])


def _kill_rank_1_mid_generate(path: str, **kw: object) -> None:
    llm = LLM(path, tensor_parallel_size=2, data_parallel_size=2, block_size=4,
              max_model_len=512, **kw)  # type: ignore[arg-type]
    procs = llm.engine.runner.followers.procs
    params = SamplingParams(max_tokens=400, temperature=0, ignore_eos=True)
    t0 = time.monotonic()
    n = 0
    err = ""
    threading.Timer(0.3, lambda: os.kill(procs[0].pid, signal.SIGKILL)).start()
    try:
        for out in llm.stream([[1, 2, 3, 4]], params, dp_ranks=[0]):
            n += len(out.new_token_ids)
    except TPRankError as e:
        err = str(e)
    took = time.monotonic() - t0
    assert "rank 1" in err and "exited with code -9" in err, err
    assert took < 30, took
    assert n < 400
    for p in procs:
        p.wait(timeout=10)
    with pytest.raises(TPRankError):
        llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2))
    llm.close()


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_gpu_a_dying_rank_fails_the_engine_without_hanging(models):
    """NCCL: the watcher aborts the communicator, so rank 0 does not wait out the timeout."""
    _kill_rank_1_mid_generate(models["qwen3_moe"], device="cuda:0", dtype="float32")


def _gpu_tokens(path: str, **kw: object) -> tuple[list[list[int]], list[list[int]]]:
    """(spread, all on group 1) greedy tokens of a DPA-TP2 engine on CUDA, float32."""
    with LLM(path, device="cuda:0", dtype="float32", tensor_parallel_size=2,
             data_parallel_size=2, **KW, **kw) as llm:  # type: ignore[arg-type]
        spread = [c.token_ids for c in llm.generate(PROMPTS, GREEDY)]
        one = [c.token_ids for c in llm.generate(PROMPTS, GREEDY,
                                                 dp_ranks=[1] * len(PROMPTS))]
    return spread, one


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("name", ["v3", "qwen3_moe"])
def test_gpu_dpa_tp2_on_one_gpu_equals_one_rank(models, name):
    """Both ranks on one GPU (host-staged collectives): the Triton kernels, MoE exchange and
    logits gather on CUDA tensors give the single-rank engine's tokens."""
    path = models[name]
    with LLM(path, device="cuda:0", dtype="float32", **KW) as llm:
        want = [c.token_ids for c in llm.generate(PROMPTS, GREEDY)]
    spread, one = _gpu_tokens(path, devices=("cuda:0", "cuda:0"),
                              extra={"tp_host_staged": True})
    assert spread == want and one == want


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
@pytest.mark.parametrize("name", ["v3", "qwen3_moe"])
def test_gpu_dpa_tp2_on_two_gpus_equals_one_rank(models, name):
    """NCCL between two GPUs."""
    path = models[name]
    with LLM(path, device="cuda:0", dtype="float32", **KW) as llm:
        want = [c.token_ids for c in llm.generate(PROMPTS, GREEDY)]
    spread, one = _gpu_tokens(path)
    assert spread == want and one == want
