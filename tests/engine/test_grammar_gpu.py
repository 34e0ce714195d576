"""Structured output on the GPU: the bitmask applied on the device equals the CPU's, and
under a grammar the CUDA-graph decode path gives the eager engine's tokens (greedy and
seeded) with every output a valid instance."""

from __future__ import annotations

import importlib.util
import json
import shutil

import pytest
import torch
from tiny_models import byte_tokenizer

from engine.sampling_params import SamplingParams
from kernels.bitmask import apply_bitmask

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 8},
    "n": {"type": "integer", "minimum": 0, "maximum": 999},
    "ok": {"type": "boolean"},
    "tags": {"type": "array", "items": {"enum": ["x", "y"]}, "maxItems": 3}},
    "required": ["name", "n", "ok", "tags"], "additionalProperties": False,
    "x-guidance": {"whitespace_flexible": False}}


@pytest.mark.gpu
@needs_cuda
def test_bitmask_on_the_device_equals_the_host() -> None:
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(33, 128256, generator=g)
    words = torch.randint(-(1 << 31), (1 << 31) - 1, (33, 4008), generator=g,
                          dtype=torch.int64).to(torch.int32)
    want = apply_bitmask(logits, words)
    got = apply_bitmask(logits.cuda(), words.cuda()).cpu()
    assert torch.equal(torch.isneginf(got), torch.isneginf(want))
    assert torch.equal(got[~torch.isneginf(got)], want[~torch.isneginf(want)])


def _check(text: str) -> None:
    v = json.loads(text)
    assert set(v) == {"name", "n", "ok", "tags"}
    assert isinstance(v["name"], str) and len(v["name"]) <= 8
    assert isinstance(v["n"], int) and 0 <= v["n"] <= 999 and isinstance(v["ok"], bool)
    assert all(t in ("x", "y") for t in v["tags"]) and len(v["tags"]) <= 3


@pytest.mark.gpu
@needs_cuda
@pytest.mark.skipif(importlib.util.find_spec("llguidance") is None,
                    reason="needs llguidance (the GPU machine lacks it unless carried)")
@pytest.mark.parametrize("seeded", [False, True], ids=["greedy", "seeded"])
def test_graphs_equal_eager_under_a_grammar(make_llm, tiny_models, tmp_path,
                                            seeded: bool) -> None:
    path = str(tmp_path / "llama")
    shutil.copytree(tiny_models["llama"], path)  # the shared copy stays tokenizer-free
    byte_tokenizer(path)
    spec = {"kind": "json_schema", "value": json.dumps(SCHEMA)}
    params = [SamplingParams(max_tokens=200, structured=spec,
                             **(dict(temperature=1.0, seed=i) if seeded
                                else dict(temperature=0.0)))
              for i in range(11)]
    prompts = [[5 + i, 17, 33, 90, 12][: 2 + i % 4] for i in range(11)]
    kw = dict(device="cuda", dtype="float32", max_num_seqs=16, max_model_len=256)
    graphed = make_llm(path, **kw)
    g = graphed.engine.runner.graphs
    out_g = graphed.generate(prompts, params)
    assert g.num_replays > 0  # the grammar rows replayed the graphed forward
    eager = make_llm(path, enforce_eager=True, **kw)
    out_e = eager.generate(prompts, params)
    eos = graphed.engine.eos_token_ids
    for a, b in zip(out_g, out_e, strict=True):
        assert a.token_ids == b.token_ids
        assert a.finish_reason == "stop" and a.token_ids[-1] in eos
        _check(graphed.tokenizer.decode(a.token_ids[:-1]))
