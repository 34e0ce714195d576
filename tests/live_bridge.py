"""A service-side ``EngineBridge`` pumping the events a test writes on the link's engine end
(no engine, no gRPC): for tests of the events link."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

from worker import ipc
from worker.event_link import EventWriter
from worker.servicer import EngineBridge


class EngineEnd:
    """The engine process's end of the events link, on the test's own loop: what the socket
    does not take at once waits in the writer, and a task flushes it as the bridge reads
    (the engine loop flushes every turn)."""

    def __init__(self, path: str) -> None:
        self.writer = EventWriter(path)
        self._flusher: asyncio.Task[None] | None = None

    async def send_multipart(self, parts: list[bytes]) -> None:
        self.writer.send_multipart(parts)
        if self.writer.pending_bytes and (self._flusher is None or self._flusher.done()):
            self._flusher = asyncio.create_task(self._flush())

    async def send(self, part: bytes) -> None:
        await self.send_multipart([part])

    async def _flush(self) -> None:
        while self.writer.pending_bytes:
            await asyncio.sleep(0.001)
            self.writer.flush()

    def close(self) -> None:
        if self._flusher is not None:
            self._flusher.cancel()
        self.writer.close(wait_s=0)


@contextlib.asynccontextmanager
async def live_bridge() -> AsyncIterator[tuple[EngineBridge, EngineEnd, asyncio.Task[None]]]:
    """(the bridge, the engine's end of its events link, the running pump task)."""
    paths = ipc.IpcPaths.fresh()
    bridge = EngineBridge(paths)
    end = EngineEnd(paths.events)
    pump = asyncio.create_task(bridge.pump())
    try:
        yield bridge, end, pump
    finally:
        pump.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await pump
        end.close()
        bridge.close()
        paths.cleanup()
