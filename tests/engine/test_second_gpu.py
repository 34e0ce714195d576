"""An engine on a GPU other than the thread's current one (a worker given --device cuda:1)."""

from __future__ import annotations

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs"),
]


def test_an_engine_on_cuda1_gives_cuda0s_tokens(tiny_models: dict[str, str]) -> None:
    from engine.llm import LLM
    from engine.sampling_params import SamplingParams

    prompts = [[5, 9, 17, 33, 2 + i] for i in range(4)]
    params = SamplingParams(max_tokens=12, temperature=0.0)
    torch.cuda.set_device(0)
    out = {}
    for dev in ("cuda:1", "cuda:0"):  # cuda:1 first, while the thread is on cuda:0
        llm = LLM(tiny_models["llama"], device=dev, dtype="float32")
        out[dev] = [c.token_ids for c in llm.generate(prompts, params)]
        assert llm.engine.kv_cache.device == torch.device(dev)
        del llm
    assert out["cuda:1"] == out["cuda:0"] and all(out["cuda:0"])
