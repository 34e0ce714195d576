"""A producer's engine on a GPU hands the host back while its step runs (``device_wait``):
the step's CUDA event is asked, not waited on, and the token read once it is done equals
the token of the same step read by blocking."""

from __future__ import annotations

import os

import pytest
import torch
from tiny_models import make_tiny_model

from engine.llm import LLM
from engine.sampling_params import SamplingParams

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
PROMPT = list(range(3, 200))
GREEDY = SamplingParams(max_tokens=4, temperature=0)


@pytest.mark.gpu
@needs_cuda
def test_a_producer_step_on_the_gpu_calls_device_wait_until_its_event_is_done(tmp_path):
    path = make_tiny_model(os.path.join(tmp_path, "llama"), "llama")
    tokens = []
    for hooked in (False, True):
        eng = LLM(path, role="producer", device="cuda:0", block_size=16).engine
        looks: list[float] = []
        if hooked:
            eng.device_wait = looks.append
        eng.add_request("r", PROMPT, GREEDY)
        # the stream is busy for ~100 ms before the step's kernels: its event cannot be
        # done at the first look
        torch.cuda._sleep(100_000_000)
        (out,) = eng.step().outputs
        tokens.append(out.new_token_ids)
        if hooked:
            assert len(looks) > 1 and set(looks) == {0.0}  # a GPU's time left is not known
    assert tokens[0] == tokens[1] and len(tokens[0]) == 1
