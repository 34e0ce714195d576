"""Which event loop a serving process runs its coroutine on: asyncio's own or uvloop.

uvloop's loop (libuv, its handles and callbacks in C) does the loop's own per-callback
work for less CPU than asyncio's selector loop; grpc.aio and aiohttp run on either. "auto"
takes uvloop when it is installed and asyncio's loop otherwise, so a process without it
still starts.
"""

from __future__ import annotations

import asyncio
import importlib.util
import logging
from collections.abc import Coroutine
from typing import Any, TypeVar

from deploy.loop_stalls import with_loop_stalls

log = logging.getLogger("pdserve.event_loop")
T = TypeVar("T")
EVENT_LOOPS = ("auto", "asyncio", "uvloop")


def resolve_event_loop(kind: str) -> str:
    """``kind`` as it will run: "asyncio" or "uvloop"."""
    if kind not in EVENT_LOOPS:
        raise ValueError(f"--event-loop: {kind!r} is not one of {', '.join(EVENT_LOOPS)}")
    if kind == "auto":
        return "uvloop" if importlib.util.find_spec("uvloop") is not None else "asyncio"
    if kind == "uvloop" and importlib.util.find_spec("uvloop") is None:
        raise ValueError("--event-loop: uvloop is not installed (pip install uvloop)")
    return kind


def run_on(kind: str, main: Coroutine[Any, Any, T]) -> T:
    """``asyncio.run(main)`` on the loop ``kind`` names (``resolve_event_loop``)."""
    resolved = resolve_event_loop(kind)
    main = with_loop_stalls(main)  # deploy/loop_stalls.py: only where PDSERVE_LOOP_STALLS is set
    # said at start-up: "auto" quietly falls back to asyncio's loop where uvloop is missing
    # (the GPU machine's Python had none until its runs carried the wheel), and that loop
    # costs more per message on every serving path
    log.info("event loop: %s (--event-loop %s)", resolved, kind)
    if resolved == "uvloop":
        import uvloop

        return uvloop.run(main)
    return asyncio.run(main)
