"""A service-side ``EngineBridge`` pumping the events a test sends on a PUSH socket that
stands for the engine process (no engine, no gRPC): for tests of the events link."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import zmq
import zmq.asyncio

from worker import ipc
from worker.servicer import EngineBridge


@contextlib.asynccontextmanager
async def live_bridge() -> AsyncIterator[tuple[EngineBridge, Any, asyncio.Task[None]]]:
    """(the bridge, the engine's side of its events socket, the running pump task)."""
    paths = ipc.IpcPaths.fresh()
    bridge = EngineBridge(paths)
    ctx = zmq.asyncio.Context()
    push = ctx.socket(zmq.PUSH)
    push.connect(paths.events)
    pump = asyncio.create_task(bridge.pump())
    try:
        yield bridge, push, pump
    finally:
        pump.cancel()
        ctx.destroy(linger=0)
        bridge.close()
        paths.cleanup()
