"""One gRPC server stream's write, started from a callback instead of a handler task.

grpc.aio sends a stream's message through ``context.write``, a coroutine that starts the
send and then waits for its completion. Awaited from the handler, every message costs a
wake-up of the handler's task (and of every generator between it and the message's
source). ``DirectWrite`` drives that coroutine by hand: ``start`` runs it up to its wait
for the completion, right where the message was made (the demultiplexing of a worker's
batch), and the completion's callback finishes it. No task wakes per message.

grpc allows one write in flight per call, so a stream has one ``DirectWrite`` and writes
only while it is ``idle``; the handler awaits ``wait_idle`` before a write of its own
(``send``), so messages leave in the order they were made.

A stream that can write synchronously (``write_now``, the SSE door's) takes the message at
once and needs no coroutine: its write then counts as in flight until the loop's next
pass, so the same batch's further tokens of the request queue behind it and leave merged.
Every stream written so within one pass is released by one callback (``_release``)
rather than one wake-up each.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from typing import Any


class WriteFailed(Exception):
    """A write to the stream failed: the call ended (the client left, the server stops)."""


def _unobserved(tokens: int) -> Any:
    return None


# The writes taken synchronously in this loop pass, per loop: released together next pass.
_held: dict[asyncio.AbstractEventLoop, list[DirectWrite]] = {}


def _hold(d: DirectWrite) -> None:
    loop = asyncio.get_running_loop()
    held = _held.get(loop)
    if held is None:
        held = _held[loop] = []
        loop.call_soon(_release, loop)
    held.append(d)


def _release(loop: asyncio.AbstractEventLoop) -> None:
    for d in _held.pop(loop, ()):
        d._finished(None)


class _Held:
    """Stands for a synchronous write in ``DirectWrite._coro`` until the next pass."""


_HELD: Any = _Held()


class DirectWrite:
    def __init__(self, context: Any, *, takes_first: bool = True) -> None:
        """takes_first: a direct write may be the stream's first message (token 0, written
        from the producer's batch). Not for an SSE stream: its handler opens the HTTP
        response with the first message (refusals before it are HTTP errors)."""
        self._context = context
        self.takes_first = takes_first
        self._write_now: Callable[[Any], bool] | None = getattr(context, "write_now", None)
        self._coro: Coroutine[Any, Any, Any] | None = None  # the write in flight
        self._idle: asyncio.Future[None] | None = None  # the handler waits for the end
        self.error: BaseException | None = None  # the first failed write (the call ended)
        self.started = 0  # writes started here (tests, metrics)
        # the request's metrics for a message of n tokens that does not end it: what the
        # handler's side counts for the messages it sends, counted for direct writes
        self.observe: Callable[[int], Any] = _unobserved

    @property
    def idle(self) -> bool:
        """No write in flight, and none failed: ``start`` may be called."""
        return self._coro is None and self.error is None

    def start(self, message: Any) -> None:
        """Starts writing ``message`` now; the caller checked ``idle``."""
        self.started += 1
        now = self._write_now
        if now is not None:
            try:
                taken = now(message)
            except Exception as e:  # noqa: BLE001 - the transport failed: the call ended
                self._finished(e)
                return
            if taken:
                self._coro = _HELD
                _hold(self)
                return
        self._coro = self._context.write(message)
        self._step(None)

    def _step(self, _: Any) -> None:
        coro = self._coro
        assert coro is not None
        try:
            waiting = coro.send(None)
        except StopIteration:
            self._finished(None)
            return
        except BaseException as e:  # noqa: BLE001 - the call failed or was cancelled
            self._finished(e)
            return
        if waiting is None:  # a bare yield: resume on the next loop pass
            asyncio.get_running_loop().call_soon(self._step, None)
            return
        # what a Task does with an awaited future: resume when it completes
        waiting._asyncio_future_blocking = False
        waiting.add_done_callback(self._step)

    def _finished(self, error: BaseException | None) -> None:
        self._coro = None
        if error is not None and self.error is None:
            self.error = error
        idle, self._idle = self._idle, None
        if idle is not None and not idle.done():
            idle.set_result(None)

    async def wait_idle(self) -> None:
        """Returns once no write is in flight; WriteFailed if a direct write failed."""
        while self._coro is not None:
            if self._idle is None:
                self._idle = asyncio.get_running_loop().create_future()
            await asyncio.shield(self._idle)
        if self.error is not None:
            raise WriteFailed(repr(self.error)) from self.error

    async def send(self, message: Any) -> None:
        """The handler's own write, after any direct one in flight."""
        if self._coro is not None or self.error is not None:
            await self.wait_idle()
        try:
            await self._context.write(message)
        except asyncio.CancelledError:
            raise
        except Exception as e:
            self.error = e
            raise WriteFailed(repr(e)) from e
