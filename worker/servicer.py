"""The worker's gRPC face (asyncio): forwards RPCs to the engine process and streams its
events back. It never touches the model, so serving never stalls scheduling."""

from __future__ import annotations

import asyncio
import hmac
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

import grpc
import zmq
import zmq.asyncio
from pdserve.v1 import common_pb2, worker_pb2, worker_pb2_grpc

from worker import ipc
from worker.convert import finish_reason_pb, sampling_to_wire, token_logprob, tokens_pb
from worker.messages import (
    AbortCmd,
    Command,
    DecodeCmd,
    DestinationCmd,
    Event,
    FatalEvent,
    MessageError,
    PrefillCmd,
    ReadyEvent,
    ReservedEvent,
    StatsEvent,
    Token0Event,
    Token0SentCmd,
    TokensEvent,
    TransferResultEvent,
    decode,
    encode,
    rid_of,
)
from worker.metrics_server import WorkerMetrics

log = logging.getLogger("pdserve.worker")
# gRPC metadata key carrying the cluster token on the router's calls (router/channels.py
# sets it; the router must not import this package, so the name is written in both)
CLUSTER_TOKEN_METADATA = "x-pdserve-cluster-token"


class EngineBridge:
    """Commands to the engine process; its events fanned out to per-request queues."""

    def __init__(self, paths: ipc.IpcPaths) -> None:
        self.ctx = zmq.asyncio.Context()
        self.events = self.ctx.socket(zmq.PULL)
        self.events.bind(paths.events)
        self.commands = self.ctx.socket(zmq.PUSH)
        self.commands.setsockopt(zmq.LINGER, 0)
        self.commands.connect(paths.commands)
        self.queues: dict[str, asyncio.Queue[Event]] = {}
        self.load: dict[str, Any] = {}
        self.ready: asyncio.Future[dict[str, Any]] = asyncio.get_event_loop().create_future()
        self.fatal: str | None = None

    def send(self, cmd: Command) -> None:
        self.commands.send(encode(cmd))

    def open(self, rid: str) -> asyncio.Queue[Event]:
        if rid in self.queues:
            raise ValueError(f"request_id: {rid!r} is already running on this worker")
        q: asyncio.Queue[Event] = asyncio.Queue()
        self.queues[rid] = q
        return q

    def close_request(self, rid: str) -> None:
        self.queues.pop(rid, None)

    async def pump(self) -> None:
        while True:
            try:
                msg = decode(await self.events.recv())
            except MessageError as e:  # one bad event must not stop every stream
                log.error("dropped a bad event from the engine process: %s", e)
                continue
            if isinstance(msg, StatsEvent):
                self.load = msg.load
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

    def fail_all(self, error: str) -> None:
        self.fatal = error
        if not self.ready.done():
            self.ready.set_exception(RuntimeError(error))
        for q in self.queues.values():
            q.put_nowait(FatalEvent(error))

    def close(self) -> None:
        self.ctx.destroy(linger=0)


class WorkerServicer(worker_pb2_grpc.WorkerServicer):
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

    async def _open(self, rid: str,
                    context: grpc.aio.ServicerContext) -> asyncio.Queue[Event]:
        if self.bridge.fatal:
            await context.abort(grpc.StatusCode.UNAVAILABLE, self.bridge.fatal)
        if not rid:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "request_id: required")
        try:
            return self.bridge.open(rid)
        except ValueError as e:
            await context.abort(grpc.StatusCode.ALREADY_EXISTS, str(e))
            raise

    async def Prefill(self, request_iterator: AsyncIterator[worker_pb2.PrefillInput],
                      context: grpc.aio.ServicerContext) -> AsyncIterator[worker_pb2.PrefillOutput]:
        await self._check_token(context)
        first = await anext(aiter(request_iterator), None)
        if first is None or first.WhichOneof("kind") != "request":
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                "request: the first PrefillInput must be a request")
            return
        req = first.request
        rid = req.request_id
        q = await self._open(rid, context)
        received = time.time_ns()
        self.bridge.send(PrefillCmd(rid, tuple(req.prompt_token_ids),
                                    sampling_to_wire(req.sampling, req.seed), received))

        async def destinations() -> None:
            async for msg in request_iterator:
                if msg.WhichOneof("kind") == "destination":
                    d = msg.destination
                    self.bridge.send(DestinationCmd(rid, d.consumer_id, d.kv_address,
                                                    tuple(d.block_ids)))

        reader = asyncio.create_task(destinations())
        done = False
        outcome = "cancelled"
        try:
            while not done:
                msg = await q.get()
                if isinstance(msg, Token0Event):
                    t0 = worker_pb2.Token0(
                        token_id=msg.token_id, text=msg.text,
                        finish_reason=finish_reason_pb(msg.finish),
                        stop_reason=msg.stop_reason,
                        sampled_ns=msg.sampled_ns, received_ns=msg.received_ns,
                        sent_ns=time.time_ns())
                    if msg.logprob is not None:
                        t0.logprob.CopyFrom(token_logprob(msg.logprob))
                    yield worker_pb2.PrefillOutput(token0=t0)
                    # Only now may the final transfer notice leave for the consumer: token 0
                    # is ahead of the consumer's first decode step on every path.
                    self.bridge.send(Token0SentCmd(rid))
                    done = bool(msg.finish)
                    outcome = str(msg.finish or outcome)
                elif isinstance(msg, TransferResultEvent):
                    outcome = "transferred" if msg.ok else "transfer_failed"
                    if msg.ok and self.metrics is not None:
                        self.metrics.kv_transfer.observe(msg.kv_transfer_ms / 1e3)
                    yield worker_pb2.PrefillOutput(transfer=worker_pb2.TransferResult(
                        ok=msg.ok, error=msg.error, kv_transfer_ms=msg.kv_transfer_ms))
                    done = True
                elif isinstance(msg, FatalEvent):
                    outcome = "engine_failed"
                    await context.abort(grpc.StatusCode.UNAVAILABLE, msg.error)
            done = True
        finally:
            self._count("prefill", outcome)
            reader.cancel()
            self.bridge.close_request(rid)
            if not done:  # the router went away or cancelled: stop the work, free blocks
                self.bridge.send(AbortCmd(rid))

    async def Decode(self, request: worker_pb2.DecodeRequest,
                     context: grpc.aio.ServicerContext) -> AsyncIterator[worker_pb2.DecodeOutput]:
        await self._check_token(context)
        rid = request.request_id
        q = await self._open(rid, context)
        self.bridge.send(DecodeCmd(rid, tuple(request.prompt_token_ids),
                                   sampling_to_wire(request.sampling, request.seed),
                                   request.colocated))
        done = False
        outcome = "cancelled"
        try:
            while not done:
                msg = await q.get()
                if isinstance(msg, ReservedEvent):
                    yield worker_pb2.DecodeOutput(reserved=worker_pb2.Reserved(
                        kv_address=msg.kv_address, block_ids=msg.block_ids))
                elif isinstance(msg, TokensEvent):
                    t = tokens_pb(msg)
                    done = t.finish_reason != common_pb2.FINISH_REASON_UNSPECIFIED
                    if done:
                        outcome = str(msg.finish)
                    yield worker_pb2.DecodeOutput(tokens=t)
                elif isinstance(msg, FatalEvent):
                    outcome = "engine_failed"
                    await context.abort(grpc.StatusCode.UNAVAILABLE, msg.error)
        finally:
            self._count("decode", outcome)
            self.bridge.close_request(rid)
            if not done:
                self.bridge.send(AbortCmd(rid))

    async def Abort(self, request: worker_pb2.WorkerAbortRequest,
                    context: grpc.aio.ServicerContext) -> worker_pb2.WorkerAbortResponse:
        await self._check_token(context)
        known = request.request_id in self.bridge.queues
        self.bridge.send(AbortCmd(request.request_id))
        return worker_pb2.WorkerAbortResponse(ok=known)

