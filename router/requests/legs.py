"""The two legs of a request: readers that turn worker streams into events. What both share,
and the consumer's (or colocated worker's) leg; the producer's is in
router/requests/producer_leg.py.

A leg only reads its stream and reports what it saw (``Report``); it decides nothing.
The request's run (``router.requests.request_run``) receives every report, so ordering questions
(token 0 vs. the consumer's tokens, a transfer failure vs. a dead consumer) and the
pairing step (forwarding the consumer's reservation to the producer) live in one place.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Coroutine
from typing import Any

import grpc
from pdserve.v1 import worker_pb2, worker_pb2_grpc

from router.control.registry import WorkerInfo
from router.requests.run_events import (
    DecodeEnded,
    Event,
    LegFailed,
    Reserved,
    TokensRead,
)
from router.requests.worker_outputs import OutputsBroken, WorkerOutputs

log = logging.getLogger(__name__)


Report = Callable[[Event], None]  # where a leg sends what it read
# A leg cancelled while its StartDecode was in flight aborts the request once it answers,
# within this bound (the run's own Abort may have reached the worker first).
ABORT_AFTER_START_S = 5.0


def _dropped(ev: Event) -> None:
    """A detached leg's reports (``Leg.detach``): the run they were for is over."""


def describe_rpc_error(worker: WorkerInfo, e: BaseException) -> tuple[grpc.StatusCode | None, str]:
    if isinstance(e, grpc.aio.AioRpcError):
        code = e.code()
        return code, (f"{worker.role_name} {worker.worker_id} ({worker.address}) failed: "
                      f"{code.name}: {e.details() or 'no details'}")
    return None, f"{worker.role_name} {worker.worker_id} ({worker.address}) failed: {e!r}"


async def abort_on_worker(stub: worker_pb2_grpc.WorkerStub, w: WorkerInfo, request_id: str,
                          timeout_s: float) -> None:
    """Worker.Abort, so the worker frees what it holds for the request; failures are logged
    (a dead worker frees everything anyway)."""
    t0 = time.monotonic()
    try:
        await stub.Abort(worker_pb2.WorkerAbortRequest(request_id=request_id), timeout=timeout_s)
    except grpc.aio.AioRpcError as e:
        log.info("Abort(%s) on %s %s failed after %.2f s: %s", request_id, w.role_name,
                 w.worker_id, time.monotonic() - t0, e.code().name)


class Leg:
    """What both legs share: the worker, its call, the task that reads the call, and the
    route of its request on the worker's Outputs stream (``outputs``), when it has one."""

    def __init__(self, worker: WorkerInfo, call: Any, report: Report,
                 outputs: WorkerOutputs | None = None) -> None:
        self.worker = worker
        self.call = call
        self.task: asyncio.Task[None] | None = None
        self._report_event = report
        self._outputs = outputs
        self._rid = ""  # the id routed on the Outputs stream
        self._routed = False  # routed there, its last entry not yet seen

    def _route_on(self, outputs: WorkerOutputs, rid: str) -> None:
        self._rid = rid
        outputs.route(rid, self)  # type: ignore[arg-type]  # each leg is a Route
        self._routed = True

    def _unroute(self) -> None:
        if self._routed:
            self._routed = False
            assert self._outputs is not None
            self._outputs.unroute(self._rid)

    def _outputs_failed(self, code: grpc.StatusCode | None, message: str) -> None:
        """The Outputs stream broke while the request was routed on it (it dropped every
        route): the leg failed."""
        self._routed = False
        w = self.worker
        self._report_event(LegFailed(
            w, code or grpc.StatusCode.UNAVAILABLE,
            f"{w.role_name} {w.worker_id} ({w.address}) failed: {message}"))

    @property
    def reading(self) -> bool:
        return self.task is not None and not self.task.done()

    def cancel(self) -> None:
        """Ends the call now: the worker sees its stream cancelled (never awaits)."""
        if self.call is not None:  # a DecodeLeg makes its call once its mode is known
            self.call.cancel()
        if self.task is not None:
            self.task.cancel()

    async def linger(self, bound_s: float) -> None:
        """Lets a leg that did its part close its stream by itself, within a bound.

        Cancelling at once would look like an abort to the worker (a producer still waiting
        for the consumer's ack, or a consumer about to send its status).
        """
        if self.task is None:
            return
        try:
            await asyncio.wait_for(asyncio.shield(self.task), bound_s)
        except (TimeoutError, asyncio.CancelledError):
            self.cancel()

    def _start(self, coro: Coroutine[Any, Any, None]) -> None:
        self.task = asyncio.get_running_loop().create_task(coro)

    def detach(self) -> None:
        """The run is over (closed): what the leg still reads goes nowhere, as the run's
        closed queue would have dropped it. Why: the leg's report calls back into the run,
        which holds the leg, so every finished request was a reference cycle (run, legs,
        their tasks and calls: ~100 objects) that only the cyclic collector frees. At c=256
        on one router those cycles made its full collections 15-60 ms stalls of the loop,
        the first-token hold's tail (bench/RESULTS.md, session 38); without the cycle the
        objects go as soon as the last task lets them."""
        self._report_event = _dropped


class DecodeLeg(Leg):
    """A consumer's (reservation, then tokens) or a colocated worker's part of a request.

    With the worker's Outputs stream (``outputs``) the request is started with a unary
    ``StartDecode`` that answers once the worker took it (or its refusal); its reservation,
    tokens and end then come from that stream, demultiplexed by request id, and the leg
    holds no call of its own. Without it (an older worker) one ``Decode`` stream carries
    all of it.
    """

    def __init__(self, worker: WorkerInfo, stub: worker_pb2_grpc.WorkerStub,
                 request: worker_pb2.DecodeRequest, outputs: WorkerOutputs | None,
                 report: Report) -> None:
        super().__init__(worker, None, report, outputs)  # call: made once the mode is known
        self._stub = stub
        self._request = request
        self._starting = False  # StartDecode in flight
        self._abort_when_started = False  # cancelled while StartDecode was in flight
        # the run's steady-state writer of tokens that go on: True when it took them
        self.direct: Callable[[worker_pb2.Tokens], bool] | None = None

    def start(self) -> None:
        self._start(self._read())

    @property
    def reading(self) -> bool:
        return self._routed or super().reading

    def cancel(self) -> None:
        self._unroute()
        if self._starting:
            # The worker may take the request after a cancel of the call reached it, and an
            # Abort sent now could overtake StartDecode: abort once it has answered.
            self._abort_when_started = True
            return
        super().cancel()

    def detach(self) -> None:
        super().detach()
        self.direct = None  # the run's writer: it holds the run as well

    async def linger(self, bound_s: float) -> None:
        if self._routed:  # its outputs come from the worker's stream: nothing to close
            self._unroute()
            return
        await super().linger(bound_s)

    # Route: what the worker's Outputs stream calls
    def on_token0(self, token0: worker_pb2.Token0, read_ns: int) -> None:
        pass  # a producer's; a consumer or colocated worker sends none

    def on_tokens(self, tokens: worker_pb2.Tokens) -> None:
        if tokens.finish_reason:  # the request's last entry on the worker's stream
            self._unroute()
        elif (direct := self.direct) is not None and direct(tokens):
            return  # written to the client already: no report object for them
        self._report_event(TokensRead(tokens))

    def on_reserved(self, reserved: worker_pb2.Reserved) -> None:
        self._report_event(Reserved(self._destination(reserved)))

    def on_transfer(self, result: worker_pb2.TransferResult) -> None:
        pass  # a producer's

    def on_outputs_broken(self, code: grpc.StatusCode | None, message: str) -> None:
        self._outputs_failed(code, message)

    def _destination(self, reserved: worker_pb2.Reserved) -> worker_pb2.KVDestination:
        return worker_pb2.KVDestination(consumer_id=self.worker.worker_id,
                                        kv_address=reserved.kv_address
                                        or self.worker.kv_address,
                                        block_ids=reserved.block_ids,
                                        cached_blocks=reserved.cached_blocks)

    async def _read(self) -> None:
        outputs = self._outputs
        batched = False
        try:
            if outputs is not None:
                try:
                    batched = await outputs.ready()
                except OutputsBroken as e:
                    self.on_outputs_broken(e.code, str(e))
                    return
            if batched:
                assert outputs is not None
                await self._start_decode(outputs)
                return
            self.call = self._stub.Decode(self._request)
            async for out in self.call:
                kind = out.WhichOneof("kind")
                if kind == "reserved":
                    self._report_event(Reserved(self._destination(out.reserved)))
                elif kind == "tokens":
                    self._report_event(TokensRead(out.tokens))
            self._report_event(DecodeEnded())
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - any failure of the leg ends the request
            code, msg = describe_rpc_error(self.worker, e)
            self._report_event(LegFailed(self.worker, code, msg))

    async def _start_decode(self, outputs: WorkerOutputs) -> None:
        """Routed before the call: the worker's first outputs may overtake its answer."""
        rid = self._request.request_id
        if not outputs.usable:  # it broke after it was ready: its routes were told then
            self.on_outputs_broken(None, f"its Outputs stream ended ({outputs.worker_id})")
            return
        self._request.subscriber_id = outputs.subscriber_id
        self._route_on(outputs, rid)
        self._starting = True
        try:
            self.call = self._stub.StartDecode(self._request)
            await self.call
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - refused, or the worker failed
            was_routed = self._routed
            self._unroute()
            if was_routed:  # not already ended (cancelled, or its stream broke)
                code, msg = describe_rpc_error(self.worker, e)
                self._report_event(LegFailed(self.worker, code, msg))
            return
        finally:
            self._starting = False
        if self._abort_when_started:
            await abort_on_worker(self._stub, self.worker, rid, ABORT_AFTER_START_S)
