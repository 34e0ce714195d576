"""The router's end of one worker's Outputs stream: per-step batches, demultiplexed.

Each worker gets one ``Outputs`` call from this router process (its subscriber id is this
process's id and a counter), opened on the first request placed there; every
``StartDecode`` and ``StartPrefill`` the router sends names it, and the worker then puts all
of that router's outputs of one engine step (reservations, tokens, ends; a producer's token
0s and transfer results) into one ``OutputBatch``. Here each
batch is read once and its entries handed to the legs by request id, so the per-token cost
is a dict lookup and a callback instead of a gRPC message read per token per request, and
a request holds no call of its own once the worker took it. A worker that advertised an
outputs address serves the same stream over plain TCP (and on its host over a Unix
socket), which is read instead (router/requests/outputs_plain.py: less CPU on both ends;
the Unix socket first, then TCP, then the RPC if neither is reachable).

Lifecycle (who moves it):

    CONNECTING ──first (empty) batch──▶ READY ──the call ends or fails──▶ BROKEN
        │ the worker answers UNIMPLEMENTED (an older worker)
        ▼
    UNSUPPORTED: requests go on Decode streams that carry their own outputs

Outputs of a request no leg routes (its run was torn down) still arriving after a while
mean the worker runs a request nobody reads: an Abort that overtook its StartDecode, or
one lost with its channel. The stream then aborts it on the worker itself, once per
request (``_orphaned``), so a lost Abort costs a few tokens, not a whole max_tokens of
decode steps (seen once in CI: a request went on decoding after its client's deadline; the
path that lost its Abort was not found, hence a net under every path).

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
import time
import uuid
from typing import Any, Protocol

import grpc
from pdserve.v1 import worker_pb2, worker_pb2_grpc

from router.requests.outputs_plain import PlainOutputsCall, PlainOutputsEnded

log = logging.getLogger(__name__)
# How long the stream's own Abort of an orphaned request may take.
ORPHAN_ABORT_S = 5.0
# Request ids remembered as aborted here (oldest forgotten first): enough for every request
# torn down while its abort was in flight, small enough to never matter for memory.
ORPHANS_KEPT = 4096
ROUTER_ID = uuid.uuid4().hex[:16]  # this process: two routers (frontends) never collide
# Entries handed on between yields to the event loop. A consumer's step at batch 256 is one
# batch of 256 entries, each written to its client on the spot (~10-30 us apiece): in one
# pass that holds every other callback (a producer's token 0, new requests) for 3-8 ms. A
# yield costs one loop iteration (~10-20 us) per slice. On the H200 the first-token hold's
# p99 at c=256 did not move with it (5.12 -> 5.19 ms, bench/RESULTS.md): that step was not
# what held token 0 there.
SLICE = 32
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

    def on_token0(self, token0: worker_pb2.Token0, read_ns: int) -> None: ...

    def on_tokens(self, tokens: worker_pb2.Tokens) -> None: ...

    def on_reserved(self, reserved: worker_pb2.Reserved) -> None: ...

    def on_transfer(self, result: worker_pb2.TransferResult) -> None: ...

    def on_outputs_broken(self, code: grpc.StatusCode | None, message: str) -> None: ...


class WorkerOutputs:
    def __init__(self, worker_id: str, stub: worker_pb2_grpc.WorkerStub,
                 outputs_address: str = "", cluster_token: str = "",
                 outputs_unix: str = "") -> None:
        self.worker_id = worker_id
        self.subscriber_id = f"{ROUTER_ID}-{next(_counter)}"
        self.state = State.CONNECTING
        self.seq = 0  # the last batch handed on
        self._routes: dict[str, Route] = {}
        self._stub = stub
        # the worker serves StartPrefill (False once a producer answered UNIMPLEMENTED: its
        # requests go on Prefill streams)
        self.start_prefill = True
        # ids aborted as orphans (insertion order: the oldest is forgotten first), and the
        # Abort calls in flight (kept so they are not collected before they finish)
        self._orphans: dict[str, None] = {}
        self._aborting: set[asyncio.Task[None]] = set()
        self._ready: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        request = worker_pb2.OutputsRequest(subscriber_id=self.subscriber_id)
        # The worker's plain stream when it has one (router/requests/outputs_plain.py): the
        # same batches at less CPU on both ends. The token rides in the request there.
        self._call: Any
        if outputs_address or outputs_unix:
            plain = worker_pb2.OutputsRequest(subscriber_id=self.subscriber_id,
                                              cluster_token=cluster_token)
            self._call = PlainOutputsCall(worker_id, outputs_address, plain,
                                          fallback=lambda: stub.Outputs(request),
                                          unix=outputs_unix)
        else:
            self._call = stub.Outputs(request)
        self._task = asyncio.get_running_loop().create_task(self._read())

    @property
    def transport(self) -> str:
        """"unix" or "tcp": the worker's plain stream over that; "grpc": the Outputs RPC (also
        after a fallback)."""
        return self._call.transport if isinstance(self._call, PlainOutputsCall) else "grpc"

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
                # producers' token 0s first: each is a client's first token, the one the
                # first-token hold measures (a token 0 of a run torn down: its Prefill call
                # was cancelled, which ended the request on the producer, or its Abort was
                # lost, and the producer holds it: aborted here)
                if batch.token0s:
                    read_ns = time.time_ns()  # the router's part of the hold starts here
                    for t0 in batch.token0s:
                        if (leg := self._routes.get(t0.request_id)) is not None:
                            leg.on_token0(t0, read_ns)
                        elif not t0.finish_reason:
                            self._orphaned(t0.request_id)
                for tr in batch.transfers:  # each a StartPrefill request's last entry
                    if (leg := self._routes.get(tr.request_id)) is not None:
                        leg.on_transfer(tr)
                    else:
                        self._orphans.pop(tr.request_id, None)
                for r in batch.reserved:  # before any token of the same request
                    if (leg := self._routes.get(r.request_id)) is not None:
                        leg.on_reserved(r)
                    else:
                        self._orphaned(r.request_id)
                tokens = batch.tokens
                for start in range(0, len(tokens), SLICE):
                    if start:  # what else is ready (a token 0, a client) runs in between
                        await asyncio.sleep(0)
                    self._hand_on(tokens[start:start + SLICE])
                self.seq = batch.seq
        except asyncio.CancelledError:
            why = "Outputs stream closed by the router"
        except PlainOutputsEnded as e:
            code = e.code
            why = f"Outputs stream failed: {code.name}: {e}"
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

    def _hand_on(self, tokens: Any) -> None:
        """Each entry to its leg (the routes are read afresh: a slice before may have ended
        some)."""
        routes = self._routes
        for t in tokens:
            leg = routes.get(t.request_id)
            if leg is not None:
                leg.on_tokens(t)
            elif t.finish_reason:  # its end: the worker holds nothing more for it
                self._orphans.pop(t.request_id, None)
            else:  # a leg already torn down, its Abort in flight or lost
                self._orphaned(t.request_id)

    def _orphaned(self, rid: str) -> None:
        """Aborts ``rid`` on the worker, once: no leg here reads its outputs any more."""
        if rid in self._orphans:
            return
        if len(self._orphans) >= ORPHANS_KEPT:
            del self._orphans[next(iter(self._orphans))]
        self._orphans[rid] = None
        task = asyncio.get_running_loop().create_task(self._abort(rid))
        self._aborting.add(task)
        task.add_done_callback(self._aborting.discard)

    async def _abort(self, rid: str) -> None:
        try:
            r = await self._stub.Abort(worker_pb2.WorkerAbortRequest(request_id=rid),
                                       timeout=ORPHAN_ABORT_S)
        except grpc.aio.AioRpcError as e:
            log.info("Abort(%s) of an orphaned request on %s failed: %s", rid, self.worker_id,
                     e.code().name)
            return
        if r.ok:  # it was still running: an earlier Abort did not reach it in time
            log.info("aborted %s on %s: its outputs came after its run ended", rid,
                     self.worker_id)

    def _broken(self, code: grpc.StatusCode | None, why: str) -> None:
        self.state = State.BROKEN
        if not self._ready.done():
            self._ready.set_exception(OutputsBroken(code, why))
            self._ready.exception()  # retrieved here: nobody may be waiting yet
        routes, self._routes = self._routes, {}
        for leg in routes.values():
            leg.on_outputs_broken(code, why)
