"""The router's end of one worker's Outputs stream: per-step batches, demultiplexed.

Each worker gets one ``Outputs`` call from this router process (its subscriber id is this
process's id and a counter), opened on the first request placed there; every
``StartDecode`` the router sends names it, and the worker then puts all of that router's
outputs of one engine step (reservations, tokens, ends) into one ``OutputBatch``. Here each
batch is read once and its entries handed to the legs by request id, so the per-token cost
is a dict lookup and a callback instead of a gRPC message read per token per request, and
a request holds no call of its own once the worker took it.

Lifecycle (who moves it):

    CONNECTING ──first (empty) batch──▶ READY ──the call ends or fails──▶ BROKEN
        │ the worker answers UNIMPLEMENTED (an older worker)
        ▼
    UNSUPPORTED: requests go on Decode streams that carry their own outputs

A BROKEN stream tells every leg routed to it (its worker failed, its engine failed or its
drain timed out, or the channel closed); ``WorkerChannels`` opens a new one for the next
request. A request's end is its entry with a finish reason, in order with its other
entries, so nothing else has to be waited for.
"""

from __future__ import annotations

import asyncio
import enum
import itertools
import logging
import uuid
from typing import Any, Protocol

import grpc
from pdserve.v1 import worker_pb2, worker_pb2_grpc

log = logging.getLogger(__name__)
ROUTER_ID = uuid.uuid4().hex[:16]  # this process: two routers (frontends) never collide
_counter = itertools.count(1)


class OutputsBroken(Exception):
    """The Outputs stream failed before it was ready (``code``: the gRPC status, if any)."""

    def __init__(self, code: grpc.StatusCode | None, message: str) -> None:
        super().__init__(message)
        self.code = code


class State(enum.Enum):
    CONNECTING = "connecting"
    READY = "ready"
    UNSUPPORTED = "unsupported"
    BROKEN = "broken"


class Route(Protocol):
    """What a leg gives the stream: where its tokens go, and what to do if it breaks."""

    def on_tokens(self, tokens: worker_pb2.Tokens) -> None: ...

    def on_reserved(self, reserved: worker_pb2.Reserved) -> None: ...

    def on_outputs_broken(self, code: grpc.StatusCode | None, message: str) -> None: ...


class WorkerOutputs:
    def __init__(self, worker_id: str, stub: worker_pb2_grpc.WorkerStub) -> None:
        self.worker_id = worker_id
        self.subscriber_id = f"{ROUTER_ID}-{next(_counter)}"
        self.state = State.CONNECTING
        self.seq = 0  # the last batch handed on
        self._routes: dict[str, Route] = {}
        self._ready: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        self._call: Any = stub.Outputs(worker_pb2.OutputsRequest(
            subscriber_id=self.subscriber_id))
        self._task = asyncio.get_running_loop().create_task(self._read())

    @property
    def usable(self) -> bool:
        return self.state in (State.CONNECTING, State.READY, State.UNSUPPORTED)

    async def ready(self) -> bool:
        """True: StartDecode calls may name this stream; False: the worker has no Outputs
        (Decode streams carry the outputs). Raises the call's error if it failed first."""
        return await asyncio.shield(self._ready)

    def route(self, rid: str, leg: Route) -> None:
        self._routes[rid] = leg

    def unroute(self, rid: str) -> None:
        self._routes.pop(rid, None)

    def close(self) -> None:
        self._call.cancel()
        self._task.cancel()

    async def _read(self) -> None:
        code: grpc.StatusCode | None = None
        why = "ended its Outputs stream"
        try:
            async for batch in self._call:
                if self.state is State.CONNECTING:
                    self.state = State.READY
                    self._ready.set_result(True)
                routes = self._routes
                for r in batch.reserved:  # before any token of the same request
                    if (leg := routes.get(r.request_id)) is not None:
                        leg.on_reserved(r)
                for t in batch.tokens:
                    leg = routes.get(t.request_id)
                    if leg is not None:  # none: a leg already torn down
                        leg.on_tokens(t)
                self.seq = batch.seq
        except asyncio.CancelledError:
            why = "Outputs stream closed by the router"
        except grpc.aio.AioRpcError as e:
            code = e.code()
            if code == grpc.StatusCode.UNIMPLEMENTED and self.state is State.CONNECTING:
                self.state = State.UNSUPPORTED
                self._ready.set_result(False)
                return
            why = f"Outputs stream failed: {code.name}: {e.details() or 'no details'}"
        except Exception as e:  # noqa: BLE001 - any failure ends the stream the same way
            why = f"Outputs stream failed: {e!r}"
        self._broken(code, why)

    def _broken(self, code: grpc.StatusCode | None, why: str) -> None:
        self.state = State.BROKEN
        if not self._ready.done():
            self._ready.set_exception(OutputsBroken(code, why))
            self._ready.exception()  # retrieved here: nobody may be waiting yet
        routes, self._routes = self._routes, {}
        for leg in routes.values():
            leg.on_outputs_broken(code, why)
