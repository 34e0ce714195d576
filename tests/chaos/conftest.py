"""The chaos tests' reference cases, computed once for both (tests/conftest.py holds the
colocated reference engine)."""

from __future__ import annotations

import pytest
from chaos.chaos_driver import Case, reference_cases


@pytest.fixture(scope="session")
def chaos_cases(colocated_llm) -> list[Case]:  # type: ignore[no-untyped-def]
    """Every (prompt, sampling) case with the colocated engine's tokens: the same for
    test_chaos and test_chaos_net, and only read by their runs."""
    return reference_cases(colocated_llm)
