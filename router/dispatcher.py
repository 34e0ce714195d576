"""Places requests on workers, tracks them, and cleans up every leg when they end.

Cleanup never awaits inside the client's (possibly cancelled) handler: RPCs are cancelled
synchronously, and ``Worker.Abort`` calls and producer lingering run as background tasks
the dispatcher owns, so a client that hangs up still frees blocks on both legs.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Coroutine
from typing import Any

import grpc
from pdserve.v1 import router_pb2, worker_pb2, worker_pb2_grpc

from router.channels import WorkerChannels
from router.config import RouterConfig
from router.legs import DecodeLeg, Ev, Event, ProducerLeg
from router.policy import Policy, place
from router.registry import COLOCATED, CONSUMER, PRODUCER, Registry, WorkerInfo
from router.request_run import RequestRun
from router.validation import PreparedRequest, RequestError

log = logging.getLogger(__name__)

# How long a leg that already did its part (a producer after token 0 ended the request or
# the consumer finished; a consumer after its last token) may take to close its stream
# before the router cancels the call.
LINGER_S = 5.0


class Dispatcher:
    def __init__(self, registry: Registry, policy: Policy, channels: WorkerChannels,
                 config: RouterConfig) -> None:
        self.registry = registry
        self.policy = policy
        self.channels = channels
        self.config = config
        self.active: dict[str, RequestRun] = {}
        self._background: set[asyncio.Task[Any]] = set()
        registry.on_drop.append(self._on_worker_drop)

    async def generate(self, prep: PreparedRequest, received_ns: int
                       ) -> AsyncIterator[router_pb2.GenerateResponse]:
        if prep.request_id in self.active:
            raise RequestError(grpc.StatusCode.ALREADY_EXISTS,
                               f"request_id: {prep.request_id!r} is already in flight")
        slot = place(self.registry, self.policy)
        if slot is None:
            raise RequestError(grpc.StatusCode.UNAVAILABLE, no_workers_message(self.registry))
        run = RequestRun(prep, slot, received_ns,
                         lambda w: self.channels.stub(w.worker_id, w.address), self.config,
                         self._unreachable)
        self.active[prep.request_id] = run
        for w in slot.workers:
            w.inflight += 1
            w.dispatched += 1
        try:
            async for resp in run.stream():
                yield resp
        finally:
            self.active.pop(prep.request_id, None)
            for w in slot.workers:
                w.inflight -= 1
            self._finish(run)

    def abort(self, request_id: str) -> bool:
        run = self.active.get(request_id)
        if run is None:
            return False
        run.post(Event(Ev.ABORT))
        return True

    async def close(self) -> None:
        for run in list(self.active.values()):
            run.post(Event(Ev.FAIL, "router shutting down"))
        # Give the handlers a moment to emit their final message and queue their aborts.
        for _ in range(50):
            if not self.active:
                break
            await asyncio.sleep(0.01)
        tasks = list(self._background)
        if tasks:
            await asyncio.wait(tasks, timeout=self.config.abort_timeout_s + 0.5)
        for t in self._background:
            t.cancel()

    # -- internals -------------------------------------------------------------------------

    def _finish(self, run: RequestRun) -> None:
        to_abort = run.legs_to_abort()
        legs = [(run.decode, run.decode_task), (run.producer, run.producer_task)]
        for leg, task in legs:
            if leg is None or task is None:
                continue
            if leg.worker in to_abort:
                leg.call.cancel()
                task.cancel()
            elif not task.done():
                self._spawn(self._linger(leg, task, leg is run.producer))
        for w in to_abort:
            self._spawn(self._abort_leg(run.stubs[w.worker_id], w, run.request_id))

    async def _linger(self, leg: ProducerLeg | DecodeLeg, task: asyncio.Task[None],
                      half_close: bool) -> None:
        """A leg that finished its part: let it close its stream by itself, within a bound.

        Cancelling at once would look like an abort to the worker (a producer still waiting
        for the consumer's ack, or a consumer about to send its status).
        """
        loop = asyncio.get_running_loop()
        end = loop.time() + LINGER_S
        if half_close and isinstance(leg, ProducerLeg):
            # bounded too: the half-close waits for the leg's write lock (a destination
            # write may hold it), and an unbounded wait here skipped the cancel below
            with contextlib.suppress(Exception):
                await asyncio.wait_for(leg.half_close(), LINGER_S)
        try:
            await asyncio.wait_for(asyncio.shield(task), max(0.0, end - loop.time()))
        except (TimeoutError, asyncio.CancelledError):
            leg.call.cancel()
            task.cancel()

    async def _abort_leg(self, stub: worker_pb2_grpc.WorkerStub, w: WorkerInfo,
                         request_id: str) -> None:
        t0 = time.monotonic()
        try:
            await stub.Abort(worker_pb2.WorkerAbortRequest(request_id=request_id),
                             timeout=self.config.abort_timeout_s)
        except grpc.aio.AioRpcError as e:
            log.info("Abort(%s) on %s %s failed after %.2f s: %s", request_id, w.role_name,
                     w.worker_id, time.monotonic() - t0, e.code().name)

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    def _on_worker_drop(self, w: WorkerInfo, reason: str) -> None:
        # The channel outlives a re-registration at the same address (the common restart).
        current = self.registry.get(w.worker_id)
        if current is None or current.address != w.address:
            self.channels.drop(w.worker_id)
        for run in self.active.values():
            if any(x is w for x in run.slot.workers):
                run.post(Event(Ev.FAIL, reason))

    def _unreachable(self, w: WorkerInfo, message: str) -> None:
        if self.registry.get(w.worker_id) is w:
            log.warning("dropping %s %s: %s", w.role_name, w.worker_id, message)
            self.registry.remove(w.worker_id, message)


def no_workers_message(registry: Registry) -> str:
    p, c, co = (len(registry.usable(r)) for r in (PRODUCER, CONSUMER, COLOCATED))
    return (f"no workers can take the request: {p} producer(s), {c} consumer(s), {co} colocated "
            f"usable; need a producer and a consumer, or a colocated worker")
