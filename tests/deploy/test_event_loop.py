"""The router process's event loop choice: uvloop when asked (and by default when
installed), asyncio's otherwise, and a clear error naming the flag for a bad choice."""

from __future__ import annotations

import asyncio
import importlib.util

import pytest

from deploy.event_loop import resolve_event_loop, run_on

HAS_UVLOOP = importlib.util.find_spec("uvloop") is not None


async def loop_module() -> str:
    return type(asyncio.get_running_loop()).__module__


def test_asyncio_runs_on_asyncios_loop() -> None:
    assert resolve_event_loop("asyncio") == "asyncio"
    assert run_on("asyncio", loop_module()).startswith("asyncio")


@pytest.mark.skipif(not HAS_UVLOOP, reason="uvloop is not installed (pyproject pins it)")
def test_uvloop_and_auto_run_on_uvloop() -> None:
    assert resolve_event_loop("auto") == "uvloop"
    assert run_on("uvloop", loop_module()).startswith("uvloop")
    assert run_on("auto", loop_module()).startswith("uvloop")


def test_a_bad_choice_names_the_flag() -> None:
    with pytest.raises(ValueError, match="--event-loop: 'tokio' is not one of"):
        resolve_event_loop("tokio")


def test_the_loop_a_process_runs_on_is_logged(caplog: pytest.LogCaptureFixture) -> None:
    # "auto" falls back to asyncio's loop where uvloop is missing; the log says which ran
    with caplog.at_level("INFO", logger="pdserve.event_loop"):
        run_on("asyncio", loop_module())
    assert "event loop: asyncio (--event-loop asyncio)" in caplog.text
