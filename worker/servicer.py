"""The worker's gRPC face (asyncio): forwards RPCs to the engine process and streams its
events back. It never touches the model, so serving never stalls scheduling. This is the
part every role shares; each role's own RPC lives in its package (producer/servicer.py:
Prefill, consumer/servicer.py: Decode)."""

from __future__ import annotations

import asyncio
import hmac
import logging
from collections.abc import AsyncIterator, Callable, Sequence

import grpc
import zmq
import zmq.asyncio
from pdserve.v1 import common_pb2, worker_pb2, worker_pb2_grpc

from engine.request_limits import check_request_id
from engine.sampling_params import SamplingParams
from worker import ipc
from worker.convert import ModelLimits, checked_request
from worker.event_link import EventReader, LinkClosed, NothingQueued
from worker.load_report import LoadReport
from worker.messages import (
    AbortCmd,
    Command,
    Event,
    FatalEvent,
    KVEventsEvent,
    KVSnapshotEvent,
    Message,
    MessageError,
    ReadyEvent,
    ReadyInfo,
    ReservedEvent,
    StatsEvent,
    Token0Event,
    Token0SentCmd,
    TransferResultEvent,
    decode,
    encode,
    rid_of,
)
from worker.metrics_server import WorkerMetrics
from worker.output_hub import (
    OutputHub,
    OutputsDone,
    Subscriber,
    SubscriberFailed,
    Token0Routed,
)
from worker.request_queue import RequestQueue
from worker.token_batch import TokensBatchEvent, TokensEvent

log = logging.getLogger("pdserve.worker")
# gRPC metadata key carrying the cluster token on the router's calls (router/requests/channels.py
# sets it; the router must not import this package, so the name is written in both)
CLUSTER_TOKEN_METADATA = "x-pdserve-cluster-token"
# Events routed per wake-up of the pump before other work on the loop gets a turn
DRAIN_BATCH = 64


class EngineBusy(Exception):
    """The engine process has not taken the commands already sent (its ZMQ high-water mark
    is reached): a new request is refused rather than queued without bound."""


class EngineBridge:
    """Commands to the engine process; its events fanned out to per-request queues."""

    def __init__(self, paths: ipc.IpcPaths) -> None:
        self.ctx = zmq.asyncio.Context()
        # read by ``pump`` from a reader callback on the loop (worker/event_link.py)
        self.events = EventReader(paths.events)
        self.commands = self.ctx.socket(zmq.PUSH)
        self.commands.setsockopt(zmq.LINGER, 0)
        self.commands.setsockopt(zmq.SNDHWM, ipc.HWM)
        self.commands.connect(paths.commands)
        self.queues: dict[str, RequestQueue] = {}
        self.hub = OutputHub()  # tokens of requests whose router reads an Outputs stream
        self._routed_token0s: list[Token0Event] = []  # this pass's, on an Outputs stream
        self.load: LoadReport | None = None  # the engine process's latest report
        self.ready: asyncio.Future[ReadyInfo] = asyncio.get_event_loop().create_future()
        # set when the events link ends (the engine process closed its end)
        self._link_done: asyncio.Future[None] = asyncio.get_event_loop().create_future()
        self.fatal: str | None = None
        # where the engine's prefix-cache events go (worker/kv_publisher.py); None: nowhere
        self.on_kv: Callable[[KVEventsEvent | KVSnapshotEvent], None] | None = None
        # told of each request started with StartDecode or StartPrefill once its last
        # entry is queued
        self.on_done: Callable[[OutputsDone], None] | None = None
        # told of each StartPrefill request's transfer result as it is queued (its metrics)
        self.on_transfer: Callable[[TransferResultEvent], None] | None = None
        # called as the engine's events wake the loop (the loop watch ticks on it)
        self.on_wake: Callable[[], None] | None = None

    def send(self, cmd: Command) -> None:
        """For commands about running requests (abort, destination, ...): never refused, so
        an abort is never lost; at the high-water mark the send waits in the event loop."""
        self.commands.send(encode(cmd))

    def send_new(self, cmd: Command) -> None:
        """A new request's command; EngineBusy when the engine is that far behind."""
        if not int(self.commands.get(zmq.EVENTS)) & zmq.POLLOUT:  # type: ignore[arg-type]
            raise EngineBusy(f"the engine process is {ipc.HWM} commands behind; retry later")
        self.commands.send(encode(cmd))

    @property
    def limits(self) -> ModelLimits:
        info = self.ready.result()
        return ModelLimits(info.vocab_size, info.max_model_len)

    def check_new(self, rid: str) -> None:
        """ValueError naming the field when ``rid`` is running here already."""
        if rid in self.queues or self.hub.owns(rid):
            raise ValueError(f"request_id: {rid!r} is already running on this worker")

    def open(self, rid: str) -> RequestQueue:
        self.check_new(rid)
        q = RequestQueue(rid)
        self.queues[rid] = q
        return q

    def running(self, rid: str) -> bool:
        return rid in self.queues or self.hub.owns(rid)

    @property
    def in_flight(self) -> int:
        """Requests running here: those on their own stream and those on an Outputs one."""
        return len(self.queues) + self.hub.running

    def close_request(self, rid: str) -> None:
        self.queues.pop(rid, None)
        self.hub.detach(rid)

    async def pump(self) -> None:
        """Routes the engine process's events until cancelled. A reader on the socket's
        descriptor wakes ``_drain``, which takes the whole messages there with non-blocking
        receives. The link ends only with the engine process, whose exit ``WorkerServer``
        handles; the pump then stops reading and waits to be cancelled."""
        loop = asyncio.get_running_loop()
        await self.events.accept()
        fd = self.events.fileno()
        loop.add_reader(fd, self._drain)
        try:
            await self._link_done  # the link ended
        finally:
            loop.remove_reader(fd)
        self.events.close()
        await loop.create_future()  # until cancelled

    def _drain(self) -> None:
        """Routes what the engine sent; the Outputs batches leave once per pass. The engine
        process sends each phase of its loop turn as one multipart message (worker/outbox.py),
        so a step's reservations and tokens share a pass and an Outputs message."""
        recv = self.events.recv_multipart
        if self.on_wake is not None:
            self.on_wake()
        try:
            for _ in range(DRAIN_BATCH):
                try:
                    parts = recv()
                except NothingQueued:
                    return  # read empty: the descriptor signals the next arrival
                except LinkClosed as e:
                    if not self._link_done.done():
                        log.info("the engine process's events link ended: %s", e)
                        self._link_done.set_result(None)
                    return
                for data in parts:
                    try:
                        self._route(decode(data))
                    except MessageError as e:  # one bad event must not stop every stream
                        log.error("dropped a bad event from the engine process: %s", e)
                    except Exception:  # nor one mishandled here: the rest still flow
                        log.exception("failed to route an event from the engine process")
            # more may be queued: let the loop's other work run before reading on
            asyncio.get_running_loop().call_soon(self._drain)
        finally:
            self._flush()

    def _route(self, msg: Message) -> None:
        if isinstance(msg, TokensBatchEvent):
            if rest := self.hub.add_batch(msg):
                for ev in msg.events(rest):  # no Outputs stream: their Decode carries them
                    if (q := self.queues.get(ev.rid)) is not None:
                        q.put_nowait(ev)
        elif isinstance(msg, TokensEvent):
            self._tokens(msg)
        elif isinstance(msg, ReservedEvent) and self.hub.add_reserved(msg):
            pass  # its Outputs stream carries it
        elif isinstance(msg, Token0Event):
            if msg.rid not in self.queues:
                if self.hub.add_token0(msg):  # a StartPrefill request's
                    self._routed_token0s.append(msg)
                else:
                    self.hub.detach(msg.rid)
            elif self.hub.add_token0(msg):
                self._routed_token0s.append(msg)  # its stream learns after the flush
            else:
                self.queues[msg.rid].put_nowait(msg)
        elif isinstance(msg, TransferResultEvent) and msg.rid not in self.queues:
            # a StartPrefill request's last entry (else a request that ended here already)
            if self.hub.add_transfer(msg) and self.on_transfer is not None:
                self.on_transfer(msg)
        elif isinstance(msg, StatsEvent):
            self.load = msg.load
        elif isinstance(msg, (KVEventsEvent, KVSnapshotEvent)):
            if self.on_kv is not None:
                self.on_kv(msg)
        elif isinstance(msg, ReadyEvent):
            if not self.ready.done():
                self.ready.set_result(msg.info)
        elif isinstance(msg, FatalEvent):
            self.fail_all(f"engine process failed: {msg.error}")
        elif isinstance(msg, Event) and rid_of(msg) in self.queues:
            self.queues[rid_of(msg)].put_nowait(msg)
        elif not isinstance(msg, Event):
            log.error("dropped a bad event from the engine process: %s is a command",
                      type(msg).KIND)

    def _tokens(self, ev: TokensEvent) -> None:
        if not self.hub.add(ev) and ev.rid in self.queues:
            self.queues[ev.rid].put_nowait(ev)  # no Outputs stream: its Decode carries them

    def _flush(self) -> None:
        """The pass's batches go out; the requests that finished in them are counted."""
        done = self.hub.flush()
        # The token 0s that left on an Outputs stream: the flush wrote their batches (or
        # woke the batches' writers) first, so each is ahead of its consumer's first decode
        # step, and the engine may let the transfer's final notice go (Token0SentCmd). It
        # is sent here, in the pass that routed them, not by each request's Prefill stream
        # task once it wakes: the engine holds its next prefill step (up to
        # TOKEN0_SENT_WAIT_S) for it, and a busy loop's task wake-up is one hop more.
        if self._routed_token0s:
            for ev in self._routed_token0s:
                q = self.queues.get(ev.rid)
                if q is not None or not ev.finish:  # a StartPrefill request has no queue
                    self.send(Token0SentCmd(ev.rid))
                if q is not None:
                    q.put_nowait(Token0Routed(ev))
            self._routed_token0s.clear()
        if self.on_done is not None:
            for d in done:
                self.on_done(d)

    def fail_all(self, error: str) -> None:
        self.fatal = error
        if not self.ready.done():
            self.ready.set_exception(RuntimeError(error))
        for q in self.queues.values():
            q.put_nowait(FatalEvent(error))
        self.hub.fail(error)

    def close(self) -> None:
        self.ctx.destroy(linger=0)
        self.events.close()


class WorkerServicer(worker_pb2_grpc.WorkerServicer):
    """The shared base: token check, opening a request's stream, Abort, counting. An RPC
    the role does not serve answers UNIMPLEMENTED (the generated base)."""

    def __init__(self, bridge: EngineBridge, worker_id: str,
                 metrics: WorkerMetrics | None = None, cluster_token: str = "") -> None:
        self.bridge = bridge
        self.worker_id = worker_id
        self.metrics = metrics
        self.cluster_token = cluster_token

    async def _check_token(self, context: grpc.aio.ServicerContext) -> None:
        """With a cluster token set, only its holder (the router) may drive this worker:
        a stray client could otherwise start prefills, reserve KV or abort requests."""
        if not self.cluster_token:
            return
        got = dict(context.invocation_metadata() or ()).get(CLUSTER_TOKEN_METADATA, "")
        if not isinstance(got, str) or not hmac.compare_digest(got.encode(),
                                                               self.cluster_token.encode()):
            await context.abort(grpc.StatusCode.UNAUTHENTICATED,
                                f"{CLUSTER_TOKEN_METADATA}: wrong or missing cluster token")

    def _count(self, rpc: str, outcome: str) -> None:
        if self.metrics is not None:
            self.metrics.requests.labels(rpc, outcome).inc()

    async def _admit(self, rpc: str, rid: str, prompt_ids: Sequence[int],
                     sampling: common_pb2.SamplingParams, seed: int,
                     context: grpc.aio.ServicerContext,
                     prior_ids: Sequence[int] = ()) -> SamplingParams:
        """The engine's sampling parameters, or INVALID_ARGUMENT naming the field (counted as
        the rpc's "invalid" outcome): nothing the engine relies on reaches it unchecked."""
        try:
            return checked_request(rid, prompt_ids, sampling, seed, self.bridge.limits,
                                   prior_ids)
        except ValueError as e:
            self._count(rpc, "invalid")
            log.warning("%s: refused a %s call from %s: %s", self.worker_id, rpc,
                        context.peer(), e)
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
            raise  # abort raises; this only tells the type checker

    async def _start(self, rpc: str, rid: str, cmd: Command,
                     context: grpc.aio.ServicerContext) -> None:
        """Sends an opened request's first command, or closes it and answers
        RESOURCE_EXHAUSTED when the engine process is a high-water mark behind."""
        try:
            self.bridge.send_new(cmd)
        except EngineBusy as e:
            self.bridge.close_request(rid)
            self._count(rpc, "busy")
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e))

    async def _check_new(self, rid: str, context: grpc.aio.ServicerContext) -> None:
        """UNAVAILABLE when the engine failed, INVALID_ARGUMENT without an id,
        ALREADY_EXISTS when the id is running here."""
        if self.bridge.fatal:
            await context.abort(grpc.StatusCode.UNAVAILABLE, self.bridge.fatal)
        if not rid:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "request_id: required")
        try:
            self.bridge.check_new(rid)
        except ValueError as e:
            await context.abort(grpc.StatusCode.ALREADY_EXISTS, str(e))

    async def _named_subscriber(self, rpc: str, subscriber_id: str,
                                context: grpc.aio.ServicerContext) -> Subscriber:
        """The open Outputs stream a request names (waiting a little: the router opens it
        just before its first request here, so the two may cross), or FAILED_PRECONDITION
        naming the field (counted as the rpc's "invalid" outcome)."""
        sub = await self.bridge.hub.wait_for(subscriber_id)
        if sub is None or sub.closed:
            self._count(rpc, "invalid")
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                f"subscriber_id: no Outputs stream {subscriber_id!r}"
                                " is open on this worker")
            raise AssertionError  # abort raises
        return sub

    async def _start_routed(self, rpc: str, rid: str, subscriber_id: str, carries: str,
                            attach: Callable[[str, Subscriber], None], cmd: Command,
                            context: grpc.aio.ServicerContext) -> None:
        """StartDecode's and StartPrefill's part after the request's checks: attaches it
        to the Outputs stream it names (``attach``) and sends its first command, or refuses
        it with the call's status (INVALID_ARGUMENT without a subscriber, FAILED_PRECONDITION
        naming one not open, ALREADY_EXISTS, RESOURCE_EXHAUSTED when the engine process is
        behind)."""
        await self._check_new(rid, context)
        if not subscriber_id:
            self._count(rpc, "invalid")
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"subscriber_id: required (the Outputs stream that carries "
                                f"{carries})")
        sub = await self._named_subscriber(rpc, subscriber_id, context)
        await self._check_new(rid, context)  # the wait may have let the same id in
        attach(rid, sub)
        try:
            self.bridge.send_new(cmd)
        except EngineBusy as e:
            self.bridge.hub.detach(rid)
            self._count(rpc, "busy")
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e))

    async def _open(self, rid: str,
                    context: grpc.aio.ServicerContext) -> RequestQueue:
        await self._check_new(rid, context)
        return self.bridge.open(rid)

    async def Outputs(self, request: worker_pb2.OutputsRequest,
                      context: grpc.aio.ServicerContext) -> AsyncIterator[worker_pb2.OutputBatch]:
        """The router's one stream for every step's tokens (worker/output_hub.py)."""
        await self._check_token(context)
        hub = self.bridge.hub
        try:
            sub, replaced = hub.subscribe(request.subscriber_id)
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
            raise
        self.orphaned(replaced, "its router opened a new Outputs stream")
        try:
            yield worker_pb2.OutputBatch(seq=0)  # subscribed: StartDecode calls may name it
            while True:
                try:
                    batch = await sub.next_batch()
                except SubscriberFailed as e:  # every request on it ended with this
                    await context.abort(grpc.StatusCode.UNAVAILABLE, str(e))
                yield batch
        finally:
            self.orphaned(hub.unsubscribe(sub), "its router's Outputs stream ended")

    def orphaned(self, rids: list[str], why: str) -> None:
        """Requests whose outputs had nowhere to go: abort them (blocks freed)."""
        for rid in rids:
            self.bridge.send(AbortCmd(rid))
        if rids:
            log.warning("%s: aborted %d request(s): %s", self.worker_id, len(rids), why)

    async def Abort(self, request: worker_pb2.WorkerAbortRequest,
                    context: grpc.aio.ServicerContext) -> worker_pb2.WorkerAbortResponse:
        await self._check_token(context)
        try:
            check_request_id(request.request_id)
        except ValueError as e:
            self._count("abort", "invalid")
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        known = self.bridge.running(request.request_id)
        self.bridge.send(AbortCmd(request.request_id))
        return worker_pb2.WorkerAbortResponse(ok=known)

