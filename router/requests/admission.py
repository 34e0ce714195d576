"""Admission control: a bounded number of running requests and a bounded FIFO of waiting
ones; anything past both is refused at once with a retry hint (never queued unboundedly).

Shared by the gRPC and HTTP front doors, so one overload policy covers every client.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
from collections.abc import AsyncIterator
from typing import Any

from router.requests.errors import Overloaded


class Admission:
    def __init__(self, max_running: int, max_queued: int, retry_after_s: float) -> None:
        self.max_running = max_running
        self.max_queued = max_queued
        self.retry_after_s = retry_after_s
        self.running = 0
        self.rejected = 0  # refusals since start, for tests and logs
        self._waiters: collections.deque[asyncio.Future[None]] = collections.deque()

    @property
    def queued(self) -> int:
        return len(self._waiters)

    @contextlib.asynccontextmanager
    async def slot(self, stop: asyncio.Event | None = None) -> AsyncIterator[bool]:
        """Holds one running slot for the body; waits (bounded) or raises Overloaded.

        stop: set while waiting (the request was aborted in the queue), it leaves the
        queue at once and the body runs without a slot (``False``).
        """
        held = await self._acquire(stop)
        try:
            yield held
        finally:
            if held:
                self._release()

    async def _acquire(self, stop: asyncio.Event | None) -> bool:
        if self.running < self.max_running and not self._waiters:
            self.running += 1
            return True
        if len(self._waiters) >= self.max_queued:
            self.rejected += 1
            raise Overloaded(f"overloaded: {self.running} requests running and "
                             f"{len(self._waiters)} queued (--max-running-requests "
                             f"{self.max_running}, --max-queued-requests {self.max_queued}); "
                             f"retry after {self.retry_after_s:g} s", self.retry_after_s)
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[None] = loop.create_future()
        self._waiters.append(fut)
        stopped = loop.create_task(stop.wait()) if stop is not None else None
        try:
            # _release hands its slot over: ``running`` already counts us
            waits: list[asyncio.Future[Any]] = [fut] if stopped is None else [fut, stopped]
            await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled():
                self._release()  # the slot arrived as the client left: pass it on
            else:
                with contextlib.suppress(ValueError):
                    self._waiters.remove(fut)
            raise
        finally:
            if stopped is not None:
                stopped.cancel()
        if fut.done():
            return True  # a slot came (a stop at the same moment ends the body at once)
        with contextlib.suppress(ValueError):
            self._waiters.remove(fut)
        return False

    def _release(self) -> None:
        while self._waiters:
            fut = self._waiters.popleft()
            if not fut.done():
                fut.set_result(None)  # the slot moves to the oldest waiter
                return
        self.running -= 1
