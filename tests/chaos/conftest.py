"""The colocated reference engine for the chaos tests (the e2e one lives in tests/e2e)."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def colocated_llm():  # type: ignore[no-untyped-def]
    from engine.llm import LLM

    return LLM(None, max_num_batched_tokens=128)
