"""The two legs of a request: readers that turn worker streams into events.

A leg only reads its stream and reports what it saw (``Report``); it decides nothing.
The request's run (``router.requests.request_run``) receives every report, so ordering questions
(token 0 vs. the consumer's tokens, a transfer failure vs. a dead consumer) and the
pairing step (forwarding the consumer's reservation to the producer) live in one place.
"""

from __future__ import annotations

import asyncio
import contextlib
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
    ProducerEnded,
    Reserved,
    Token0Read,
    TokensRead,
    TransferRead,
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


class ProducerLeg(Leg):
    """The bidi Prefill stream: request first, destination when the consumer reserved.

    With the producer's Outputs stream (``outputs``, ready) the request names it, and token
    0 comes from there, in one message with the step's other token 0s; the Prefill stream
    then carries only the transfer's result. The two streams are not ordered with each
    other, so a result that says token 0 went before it (``token0_routed``) is reported
    only once token 0 was: the run sees the producer's events in the order it sent them. A
    result without it (a refusal before the prefill) and the stream's end wait for nothing;
    a token 0 that ends the request comes on the Prefill stream. Without the Outputs stream
    (an older worker, or it failed before the request) token 0 comes on the Prefill stream
    as before.
    """

    def __init__(self, worker: WorkerInfo, call: Any, report: Report,
                 outputs: WorkerOutputs | None = None) -> None:
        super().__init__(worker, call, report, outputs)  # call: grpc.aio.StreamStreamCall
        self._write_lock = asyncio.Lock()  # grpc.aio allows one outstanding write
        self._closed_writing = False
        # set once the request was written (or never will be): every later write waits for
        # it. The reading task writes the request, and a task runs only at the loop's next
        # turn, while a destination sent right after start() (a retried producer, whose
        # consumer had reserved already) took the free lock at once: the producer got the
        # destination and the stream's half-close before any request
        self._request_sent = asyncio.Event()
        self._holding: asyncio.Task[None] | None = None  # hold_until_reserved, kept alive
        # set once token 0 came from the Outputs stream, or that stream broke first;
        # None: token 0 comes on the Prefill stream
        self._token0_came: asyncio.Event | None = None

    def start(self, request: worker_pb2.PrefillRequest,
              hold: tuple[DecodeLeg, float, Callable[[], bool]] | None = None) -> None:
        """``hold``: (the consumer's leg, interval, the run ended?) for hold_until_reserved."""
        self._start(self._read(request))
        if hold is not None:  # it ends by itself: paired, the run ended, or a leg gone
            self._holding = asyncio.get_running_loop().create_task(
                hold_until_reserved(self, *hold))

    async def linger(self, bound_s: float) -> None:
        loop = asyncio.get_running_loop()
        end = loop.time() + bound_s
        # bounded too: the half-close waits for the write lock (a destination write may
        # hold it), and an unbounded wait here skipped the cancel
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self.half_close(), bound_s)
        await super().linger(max(0.0, end - loop.time()))

    def cancel(self) -> None:
        self._unroute()
        self._request_sent.set()  # nothing waits for a request that will not be written
        super().cancel()

    async def _read(self, request: worker_pb2.PrefillRequest) -> None:
        try:
            # The request is the stream's first message: a hold or the destination waits
            # for it (_request_sent), then for the lock.
            try:
                async with self._write_lock:
                    if self._outputs is not None:
                        await self._route(request, self._outputs)
                    if not self._closed_writing:
                        await self.call.write(worker_pb2.PrefillInput(request=request))
            finally:
                self._request_sent.set()
            while True:
                out = await self.call.read()
                if out is grpc.aio.EOF:
                    # after its result (reported in order), or its token 0 ended the request
                    # (that one comes on this stream), or it broke the protocol: no wait
                    self._unroute()
                    self._report_event(ProducerEnded())
                    return
                kind = out.WhichOneof("kind")
                if kind == "token0":
                    self._unroute()
                    self._report_event(Token0Read(out.token0, time.time_ns()))
                elif kind == "transfer":
                    if out.transfer.token0_routed:
                        await self._after_token0()
                    self._unroute()
                    self._report_event(TransferRead(out.transfer))
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - any failure of the leg ends the request
            self._unroute()
            await self._report(e)

    async def _route(self, request: worker_pb2.PrefillRequest, outputs: WorkerOutputs) -> None:
        """Names the Outputs stream in the request and routes token 0 from it, when the
        stream is ready; otherwise the Prefill stream carries token 0."""
        try:
            batched = await outputs.ready()
        except OutputsBroken:
            return  # the producer serves token 0 on the Prefill stream all the same
        if not batched or not outputs.usable:
            return
        request.subscriber_id = outputs.subscriber_id
        self._token0_came = asyncio.Event()
        self._route_on(outputs, request.request_id)

    async def _after_token0(self) -> None:
        if self._token0_came is not None:
            await self._token0_came.wait()

    # Route: what the producer's Outputs stream calls
    def on_token0(self, token0: worker_pb2.Token0, read_ns: int) -> None:
        self._unroute()
        self._report_event(Token0Read(token0, read_ns))
        assert self._token0_came is not None
        self._token0_came.set()

    def on_tokens(self, tokens: worker_pb2.Tokens) -> None:
        pass  # a producer sends none for its requests

    def on_reserved(self, reserved: worker_pb2.Reserved) -> None:
        pass  # nor reservations

    def on_outputs_broken(self, code: grpc.StatusCode | None, message: str) -> None:
        """The stream failed before token 0 came on it: the token may have gone with it."""
        self._outputs_failed(code, f"before token 0: {message}")
        assert self._token0_came is not None
        self._token0_came.set()

    async def send_destination(self, dest: worker_pb2.KVDestination) -> None:
        """Forwards the consumer's reservation, then half-closes: nothing else will follow."""
        try:
            await self._write(worker_pb2.PrefillInput(destination=dest))
            await self.half_close()
        except Exception:  # noqa: BLE001 - the read side reports the call's real status
            pass

    @property
    def paired(self) -> bool:
        """The destination went out (and the input was closed): no more holds."""
        return self._closed_writing

    async def hold(self, consumer_id: str) -> None:
        """The consumer is alive and its reservation waits: the producer keeps the blocks."""
        await self._write(worker_pb2.PrefillInput(
            queued=worker_pb2.ReservationQueued(consumer_id=consumer_id)))

    async def half_close(self) -> None:
        await self._request_sent.wait()
        async with self._write_lock:
            if not self._closed_writing and not self.call.done():
                self._closed_writing = True
                await self.call.done_writing()

    async def _write(self, msg: worker_pb2.PrefillInput) -> None:
        await self._request_sent.wait()
        async with self._write_lock:
            if self._closed_writing:
                return
            await self.call.write(msg)

    async def _report(self, e: BaseException) -> None:
        if not isinstance(e, grpc.aio.AioRpcError):
            # A write on a failed call raises a generic error; the call's status says why.
            try:
                code = await asyncio.wait_for(self.call.code(), 1.0)
                details = await self.call.details()
                msg = (f"{self.worker.role_name} {self.worker.worker_id} "
                       f"({self.worker.address}) failed: {code.name}: {details}")
                self._report_event(LegFailed(self.worker, code, msg))
                return
            except Exception:  # noqa: BLE001
                pass
        code, msg = describe_rpc_error(self.worker, e)
        self._report_event(LegFailed(self.worker, code, msg))


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


async def hold_until_reserved(producer: ProducerLeg, decode: DecodeLeg, interval_s: float,
                              done: Callable[[], bool]) -> None:
    """Until the destination went to the producer (or ``done()``: the run ended), renews its
    lease on the prefilled blocks while the consumer's stream is open. A consumer that stops
    heartbeating is dropped by the registry, which ends the attempt and so the renewals: the
    producer then frees the blocks within its lease."""
    try:
        while True:
            await asyncio.sleep(interval_s)
            if (done() or producer.paired or not decode.reading
                    or not producer.reading):
                return
            await producer.hold(decode.worker.worker_id)
    except asyncio.CancelledError:
        raise
    except Exception:  # noqa: BLE001 - the leg's reader reports the call's failure
        return
