"""Fixtures for the engine tests."""

from __future__ import annotations

import os

import pytest
from tiny_models import make_tiny_model


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("tiny")
    return {a: make_tiny_model(os.path.join(root, a), a, seed=i)
            for i, a in enumerate(("llama", "qwen2", "qwen3", "mistral", "llama3"))}


@pytest.fixture(scope="session")
def hf_smollm2():  # type: ignore[no-untyped-def]
    """transformers' own load of the embedded SmolLM2 GGUF, in eval mode, built once: it
    takes ~7 s on 2 cores (~14 s without tests/hf_gguf.py), and the tests only read the
    model (its weights, greedy generation)."""
    import torch
    import transformers
    from hf_gguf import memoized_gguf

    from engine.model_source import resolve_model

    path = resolve_model("smollm2")
    with memoized_gguf():  # the same model, in half the time (tests/hf_gguf.py)
        return transformers.AutoModelForCausalLM.from_pretrained(
            os.path.dirname(path), gguf_file=os.path.basename(path),
            dtype=torch.float32).eval()


@pytest.fixture
def make_llm():  # type: ignore[no-untyped-def]
    """Builds LLMs and, after the test, checks each one's KV pool is whole again."""
    from engine.llm import LLM

    made: list[LLM] = []

    def make(model: str | None, **kw: object) -> LLM:
        llm = LLM(model, **kw)
        made.append(llm)
        return llm

    yield make
    for llm in made:
        acc = llm.engine.block_accounting()
        assert acc.free == acc.total and acc.used == 0, acc
        assert not llm.engine.requests, list(llm.engine.requests)


