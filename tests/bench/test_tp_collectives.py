"""bench/tp_collectives.py: the collectives it times are the ones a real TP2 engine issues
(counted on rank 0's group during a prefill step and a decode step), and timing them on two
gloo ranks returns a pass per plan."""

from __future__ import annotations

import json
import os
import sys
from typing import Any

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
from bench.tp_collectives import Collective, step_collectives, time_collectives  # noqa: E402
from deploy.benchmark.dummy_model import write_dummy_model  # noqa: E402
from engine.config import EngineConfig  # noqa: E402
from engine.llm import build_engine  # noqa: E402
from engine.sampling_params import SamplingParams  # noqa: E402


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, dict[str, Any]]:
    path = write_dummy_model(str(tmp_path_factory.mktemp("tpc") / "m"), "tiny")
    with open(os.path.join(path, "config.json")) as f:
        return path, json.load(f)


def _recording(group: Any) -> list[Collective]:
    """Wraps rank 0's collectives (the model's layers hold this same group object)."""
    seen: list[Collective] = []
    for kind, method in (("all_reduce", "all_reduce"), ("all_gather", "all_gather_cat"),
                         ("broadcast", "broadcast")):
        real = getattr(group, method)

        def wrapped(x: Any, *a: Any, _real: Any = real, _kind: str = kind) -> Any:
            seen.append(Collective(_kind, tuple(x.shape), str(x.dtype).removeprefix("torch.")))
            return _real(x, *a)

        setattr(group, method, wrapped)
    return seen


def test_step_collectives_match_a_real_tp2_engine(tiny) -> None:  # type: ignore[no-untyped-def]
    path, cfg = tiny
    engine = build_engine(EngineConfig(model=path, device="cpu", dtype="float32",
                                       load_format="dummy", max_num_batched_tokens=64,
                                       max_num_seqs=4, kv_cache_bytes=16 << 20,
                                       tensor_parallel_size=2))
    try:
        seen = _recording(engine.runner.followers.group)
        # prefill: 40 tokens in one step, one sampled row
        engine.add_request("p", [3 + j for j in range(40)], SamplingParams(max_tokens=1))
        engine.step()
        assert seen == step_collectives(cfg, 2, 40, 1, "float32")
        while engine.has_unfinished():
            engine.step()
        # decode: 3 requests, one token each, all sampled
        params = SamplingParams(max_tokens=8, ignore_eos=True)
        for i in range(3):
            blocks = engine.reserve(20)
            assert blocks is not None
            engine.add_prefilled(f"d{i}", [5 + j for j in range(20)], params, blocks,
                                 first_token=7)
        seen.clear()
        engine.step()
        plan = step_collectives(cfg, 2, 3, 3, "float32", broadcast=False)
        assert seen == plan
        # 1 + 2 per layer all-reduces of [3, hidden], then the head's gather; every rank
        # samples the same ids in the decode graphs' head, so nothing is broadcast
        assert len(plan) == 2 * cfg["num_hidden_layers"] + 2
        assert plan[-1] == Collective("all_gather", (3, 16000), "float32")
        # a row that needs the eager sampler (top-k): rank 0 broadcasts what it drew
        seen.clear()
        blocks = engine.reserve(20)
        assert blocks is not None
        engine.add_prefilled("k", [5 + j for j in range(20)],
                             SamplingParams(max_tokens=8, top_k=5, ignore_eos=True), blocks,
                             first_token=7)
        engine.step()
        assert seen[-1].kind == "broadcast" and seen[-1].nbytes == 4 * 8
    finally:
        engine.runner.close()


@pytest.mark.slow
def test_time_collectives_on_two_gloo_ranks(tiny) -> None:  # type: ignore[no-untyped-def]
    _, cfg = tiny
    plans = {"decode": step_collectives(cfg, 2, 4, 4, "float32"),
             "empty_head": [Collective("broadcast", (1,), "int64")]}
    got = time_collectives(plans, 2, "cpu", iters=3, timeout_s=60)
    assert set(got) == {"decode", "empty_head"}
    d = got["decode"]
    assert d["ops"] == 2 * cfg["num_hidden_layers"] + 3 and d["graph"] is False
    # 5 all-reduces of [4, 256] fp32, a [4, 16000] fp32 gather, a [4] int64 broadcast
    assert d["mib"] == round((5 * 4 * 256 * 4 + 4 * 16000 * 4 + 4 * 8) / 2**20, 2)
    assert 0 < d["ms"] < 5_000 and 0 < got["empty_head"]["ms"] < 5_000
