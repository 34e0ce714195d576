"""Keeps every router process's event loop from sleeping: an A/B of the first-token hold's
late reads, no product change.

Why: on an H200 the hold's c=16 tail is one late read per run, in which the router's loop
thread was off the CPU without waiting for one (bench/RESULTS.md, session 52), and the
router has no other thread that takes the GIL (its threads are the loop's, grpc's poller,
which polls without the GIL, and an idle executor thread: RESULTS, session 53). What is left
is a wake-up that came late: the loop slept in epoll and its virtual CPU was not run soon
enough after the data arrived. A loop that never sleeps has no wake-up to wait for; if the
tail goes with it, that is the cause (and a busy-polling router, a core per frontend, the
price of removing it).

Python imports ``sitecustomize`` at start from the first directory of its path that has one;
bench/serving_path_gpu.sh puts this directory first with SITE_DIR, so the router's mirror
frontends (started by the primary, not through SERVE_PY) get it too. Only processes started
as ``-m deploy.cli router`` are changed: each callback run schedules the next, so the loop
always has one ready and polls with a zero timeout.
"""

from __future__ import annotations

import sys
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


def _is_router(argv: list[str]) -> bool:
    return "deploy.cli" in argv and argv[argv.index("deploy.cli") + 1:][:1] == ["router"]


def _install() -> None:
    import asyncio

    import deploy.event_loop as event_loop

    run_on = event_loop.run_on

    async def spinning(main: Coroutine[Any, Any, T]) -> T:
        loop = asyncio.get_running_loop()

        def spin() -> None:
            loop.call_soon(spin)

        loop.call_soon(spin)
        print("spin_site: this router's loop never sleeps", file=sys.stderr, flush=True)
        return await main

    def run_on_spinning(kind: str, main: Coroutine[Any, Any, T]) -> T:
        return run_on(kind, spinning(main))

    event_loop.run_on = run_on_spinning


if _is_router(getattr(sys, "orig_argv", [])):
    _install()
