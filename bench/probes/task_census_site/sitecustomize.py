"""Counts the asyncio tasks alive on every router process's loop, by coroutine, once a
second: how many tasks a request in flight keeps (what the router's collections walk is
mostly asyncio's tasks, coroutines and contexts: bench/RESULTS.md, "The router's full
collections under a burst").

    SITE_DIR=bench/probes/task_census_site ONLY="pd_seeds" ... \
        bash bench/serving_path_gpu.sh OUT ...
    grep TASKS OUT/router_pd.log | sort -k2 -n | tail -1

Each line: ``TASKS <total> pid <pid> [(coroutine, count), ...]`` (the 12 commonest). Imported
by every process whose path has this directory first; only ``-m deploy.cli router`` counts.
"""

from __future__ import annotations

import collections
import os
import sys
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


def _is_router(argv: list[str]) -> bool:
    return "deploy.cli" in argv and argv[argv.index("deploy.cli") + 1:][:1] == ["router"]


def _name(task: Any) -> str:
    coro = task.get_coro()
    return getattr(coro, "__qualname__", type(coro).__name__)


def _install() -> None:
    import asyncio

    import deploy.event_loop as event_loop

    run_on = event_loop.run_on

    async def census() -> None:
        while True:
            await asyncio.sleep(1.0)
            tasks = asyncio.all_tasks()
            kinds = collections.Counter(_name(t) for t in tasks)
            print(f"TASKS {len(tasks)} pid {os.getpid()} {kinds.most_common(12)}",
                  file=sys.stderr, flush=True)

    async def counted(main: Coroutine[Any, Any, T]) -> T:
        task = asyncio.get_running_loop().create_task(census())
        try:
            return await main
        finally:
            task.cancel()

    def run_on_counted(kind: str, main: Coroutine[Any, Any, T]) -> T:
        return run_on(kind, counted(main))

    event_loop.run_on = run_on_counted


if _is_router(getattr(sys, "orig_argv", [])):
    _install()
