"""A request's producer leg: the prefill, token 0, and the consumer's destination sent on.

Three ways, by what the producer serves (the first that it does):

- **StartPrefill** (the producer's Outputs stream is ready and it has the RPC): a unary
  call starts the request and answers once the producer took it; token 0 and then the
  transfer's result come on the Outputs stream, in order, and the destination and the
  lease renewals go in with unary ``PrefillControl`` calls. The leg holds no call and no
  task once started: a Prefill stream held three tasks per request in flight (the stream's
  reader and grpc's two), which every collection of the router's heap walked
  (bench/RESULTS.md, session 53).
- **A Prefill stream whose token 0 comes on the Outputs stream** (a producer without
  StartPrefill): the bidi stream carries the request, the destination and the transfer's
  result; the two streams are not ordered with each other, so a result that says token 0
  went before it (``token0_routed``) is reported only once token 0 was. A token 0 that
  ends the request comes on the Prefill stream.
- **A Prefill stream that carries everything** (no Outputs stream).

Whichever way, the run sees the same events in the same order: Token0Read, then
TransferRead (or a LegFailed), and writes (``hold``, ``send_destination``) never overtake
the request.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable

import grpc
from pdserve.v1 import worker_pb2, worker_pb2_grpc

from router.control.registry import WorkerInfo
from router.requests.legs import (
    ABORT_AFTER_START_S,
    DecodeLeg,
    Leg,
    Report,
    abort_on_worker,
    describe_rpc_error,
)
from router.requests.run_events import LegFailed, ProducerEnded, Token0Read, TransferRead
from router.requests.worker_outputs import OutputsBroken, WorkerOutputs

# A PrefillControl call's bound: a producer that does not answer in this time fails the
# request through its Outputs stream or its lease, not through a write that never ends.
CONTROL_TIMEOUT_S = 10.0


class ProducerLeg(Leg):
    """The producer's part of a request (module docstring): StartPrefill when it can, else
    the bidi Prefill stream."""

    def __init__(self, worker: WorkerInfo, stub: worker_pb2_grpc.WorkerStub, report: Report,
                 outputs: WorkerOutputs | None = None) -> None:
        super().__init__(worker, None, report, outputs)  # call: a Prefill stream's, if any
        self._stub = stub
        self._write_lock = asyncio.Lock()  # grpc.aio allows one outstanding write
        self._closed_writing = False
        # set once the request was sent (or never will be): every later write waits for
        # it. The reading task sends the request, and a task runs only at the loop's next
        # turn, while a destination sent right after start() (a retried producer, whose
        # consumer had reserved already) took the free lock at once: the producer got the
        # destination and the stream's half-close before any request
        self._request_sent = asyncio.Event()
        # the next lease renewal's timer (``_hold_due``), and a renewal in flight (kept alive)
        self._hold_timer: asyncio.TimerHandle | None = None
        self._holding: asyncio.Task[None] | None = None
        # set once token 0 came from the Outputs stream, or that stream broke first;
        # None: token 0 comes on the Prefill stream
        self._token0_came: asyncio.Event | None = None
        self._control = False  # started with StartPrefill: no call of its own
        self._starting = False  # StartPrefill in flight
        self._abort_when_started = False  # cancelled while StartPrefill was in flight
        # when the destination went out (Unix ns; 0: not yet): as it is written on a Prefill
        # stream, as its PrefillControl call is made, not when that call answers
        self.destination_sent_ns = 0

    def start(self, request: worker_pb2.PrefillRequest,
              hold: tuple[DecodeLeg, float, Callable[[], bool]] | None = None) -> None:
        """``hold``: (the consumer's leg, interval, the run ended?) for the lease renewals."""
        self._start(self._read(request))
        if hold is not None:  # it ends by itself: paired, the run ended, or a leg gone
            self._hold_timer = asyncio.get_running_loop().call_later(
                hold[1], self._hold_due, *hold)

    def _hold_due(self, decode: DecodeLeg, interval_s: float, done: Callable[[], bool]
                  ) -> None:
        """Until the destination went to the producer (or ``done()``: the run ended),
        renews its lease on the prefilled blocks every ``interval_s`` while the consumer's
        leg reads. A timer, not a task per request: most requests pair long before the
        first renewal is due, and a sleeping task (its coroutine, context and future) was
        one more object graph per request in flight for the collector to walk. A consumer
        that stops heartbeating is dropped by the registry, which ends the run and so the
        renewals: the producer then frees the blocks within its lease."""
        self._hold_timer = None
        if done() or self.paired or not decode.reading or not self.reading:
            return
        self._holding = asyncio.get_running_loop().create_task(
            self._renew(decode, interval_s, done))

    async def _renew(self, decode: DecodeLeg, interval_s: float, done: Callable[[], bool]
                     ) -> None:
        try:
            await self.hold(decode.worker.worker_id)
        except Exception:  # noqa: BLE001 - the leg's reader reports the call's failure
            return
        self._hold_timer = asyncio.get_running_loop().call_later(
            interval_s, self._hold_due, decode, interval_s, done)

    @property
    def reading(self) -> bool:
        return self._routed or super().reading

    async def linger(self, bound_s: float) -> None:
        if self._control:
            # it ends by itself, with its transfer's result: nothing to close or abort
            self._unroute()
            return
        loop = asyncio.get_running_loop()
        end = loop.time() + bound_s
        # bounded too: the half-close waits for the write lock (a destination write may
        # hold it), and an unbounded wait here skipped the cancel
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self.half_close(), bound_s)
        await super().linger(max(0.0, end - loop.time()))

    def cancel(self) -> None:
        self._unroute()
        if self._hold_timer is not None:
            self._hold_timer.cancel()
            self._hold_timer = None
        self._request_sent.set()  # nothing waits for a request that will not be written
        if self._starting:
            # The producer may take the request after a cancel of the call reached it, and
            # the run's Abort could overtake StartPrefill: abort once it has answered.
            self._abort_when_started = True
            return
        super().cancel()

    async def _read(self, request: worker_pb2.PrefillRequest) -> None:
        try:
            # The request goes first: a hold or the destination waits for it
            # (_request_sent), then for the lock.
            try:
                async with self._write_lock:
                    if self._outputs is not None and await self._start_prefill(request):
                        return  # started, refused or failed: the Outputs stream goes on
                    if self._outputs is not None:
                        await self._route(request, self._outputs)
                    self.call = self._stub.Prefill()
                    if not self._closed_writing:
                        await self.call.write(worker_pb2.PrefillInput(request=request))
            finally:
                self._request_sent.set()
            await self._read_stream()
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - any failure of the leg ends the request
            self._unroute()
            await self._report(e)
        finally:
            if self._abort_when_started:
                self._abort_when_started = False
                await abort_on_worker(self._stub, self.worker, request.request_id,
                                      ABORT_AFTER_START_S)

    async def _start_prefill(self, request: worker_pb2.PrefillRequest) -> bool:
        """StartPrefill, when the Outputs stream is ready and the producer serves it. True:
        it answered (started, or refused: then reported); False: the Prefill stream goes
        on with the request (no stream, or the producer lacks the RPC)."""
        outputs = self._outputs
        assert outputs is not None
        try:
            if not await outputs.ready() or not outputs.start_prefill:
                return False
        except OutputsBroken:
            return False  # the producer serves token 0 on the Prefill stream all the same
        if self._closed_writing or not outputs.usable:
            return False
        request.subscriber_id = outputs.subscriber_id
        self._route_on(outputs, request.request_id)  # token 0 may overtake the answer
        self._control = self._starting = True
        try:
            await self._stub.StartPrefill(request)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - refused, or the producer failed
            was_routed = self._routed
            self._unroute()
            if (isinstance(e, grpc.aio.AioRpcError)
                    and e.code() == grpc.StatusCode.UNIMPLEMENTED and was_routed):
                # (a leg cancelled meanwhile is no longer routed: it stops here)
                outputs.start_prefill = False  # an older producer: its Prefill stream
                self._control = False
                request.subscriber_id = ""
                return False
            if was_routed:  # not already ended (cancelled, or its stream broke)
                code, msg = describe_rpc_error(self.worker, e)
                self._report_event(LegFailed(self.worker, code, msg))
        finally:
            self._starting = False
        return True

    async def _read_stream(self) -> None:
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
                if out.transfer.token0_routed and self._token0_came is not None:
                    await self._token0_came.wait()
                self._unroute()
                self._report_event(TransferRead(out.transfer))

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

    # Route: what the producer's Outputs stream calls
    def on_token0(self, token0: worker_pb2.Token0, read_ns: int) -> None:
        if not self._control or token0.finish_reason:  # else its result is still to come
            self._unroute()
        self._report_event(Token0Read(token0, read_ns))
        if self._token0_came is not None:
            self._token0_came.set()

    def on_transfer(self, result: worker_pb2.TransferResult) -> None:
        self._unroute()  # a StartPrefill request's last entry
        self._report_event(TransferRead(result))

    def on_tokens(self, tokens: worker_pb2.Tokens) -> None:
        pass  # a producer sends none for its requests

    def on_reserved(self, reserved: worker_pb2.Reserved) -> None:
        pass  # nor reservations

    def on_outputs_broken(self, code: grpc.StatusCode | None, message: str) -> None:
        """The stream failed before the request's last entry on it: what it still owed
        (token 0, the result) may have gone with it."""
        what = "before its transfer's result" if self._control else "before token 0"
        self._outputs_failed(code, f"{what}: {message}")
        if self._token0_came is not None:
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
            if self._closed_writing:
                return
            self._closed_writing = True
            if self.call is not None and not self.call.done():
                await self.call.done_writing()

    async def _write(self, msg: worker_pb2.PrefillInput) -> None:
        await self._request_sent.wait()
        async with self._write_lock:
            if self._closed_writing:
                return
            if msg.HasField("destination"):
                self.destination_sent_ns = time.time_ns()
            if not self._control:
                if self.call is not None:
                    await self.call.write(msg)
                return
            # (sent even if the request ended meanwhile: the producer then answers that it
            # knows no such request, and a destination the run sent before a linger is not
            # lost to it)
            control = worker_pb2.PrefillControlRequest(request_id=self._rid)
            kind = msg.WhichOneof("kind")
            getattr(control, kind).CopyFrom(getattr(msg, kind))
            await self._stub.PrefillControl(control, timeout=CONTROL_TIMEOUT_S)

    async def _report(self, e: BaseException) -> None:
        if not isinstance(e, grpc.aio.AioRpcError) and self.call is not None:
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

