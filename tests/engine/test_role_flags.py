"""A role's meaning to the engine is two flags (engine/config.py ROLE_FLAGS); the engine
reads the flags, so a flag given explicitly wins over the role's default."""

from __future__ import annotations

import pytest

from engine.config import ROLE_FLAGS, ROLES, EngineConfig


@pytest.mark.parametrize("role", ROLES)
def test_each_role_has_its_flags(role: str) -> None:
    cfg = EngineConfig(role=role)
    assert cfg.prefills_only is (role == "producer")
    assert cfg.defers_output is (role != "producer")  # a producer never defers


def test_an_explicit_flag_wins_over_the_role() -> None:
    assert EngineConfig(role="colocated", prefill_only=True).prefills_only
    assert not EngineConfig(role="producer", prefill_only=False).prefills_only
    assert EngineConfig(role="producer", defer_output=True).defers_output
    assert set(ROLE_FLAGS) == set(ROLES)


def test_the_engine_marks_requests_by_the_flag_not_the_role(tiny_models) -> None:  # type: ignore[no-untyped-def]
    from engine.llm import LLM
    from engine.sampling_params import SamplingParams

    with LLM(tiny_models["llama"], block_size=4, role="colocated", prefill_only=True,
             defer_output=False) as llm:
        llm.engine.add_request("r", [5, 6, 7], SamplingParams(max_tokens=4))
        assert llm.engine.requests["r"].prefill_only
