"""The producer's gRPC face: Prefill streams token 0 and the transfer's outcome back to the
router, and forwards the consumer's destination to the engine process. A Prefill that names
the router's Outputs stream (``subscriber_id``) gets its token 0 there instead, in one
message with the step's other token 0s (worker/output_hub.py).

StartPrefill only starts the request: token 0 and the transfer's outcome both go to the
Outputs stream it names, and PrefillControl brings the destination and the lease renewals,
so no call stays open per request (the router's side of a Prefill stream was three tasks
per request in flight, the walk of every collection: bench/RESULTS.md, session 53)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import grpc
from pdserve.v1 import worker_pb2

from engine.sampling_params import SamplingParams
from worker.convert import fill_token0
from worker.messages import (
    AbortCmd,
    DestinationCmd,
    FatalEvent,
    HoldCmd,
    PrefillCmd,
    Token0Event,
    Token0SentCmd,
    TransferResultEvent,
)
from worker.metrics_server import WorkerMetrics
from worker.output_hub import OutputsDone, Token0Routed
from worker.servicer import EngineBridge, WorkerServicer


def _prefill_cmd(req: worker_pb2.PrefillRequest, wire: SamplingParams,
                 received_ns: int) -> PrefillCmd:
    return PrefillCmd(req.request_id, tuple(req.prompt_token_ids), wire, received_ns,
                      tuple(req.prior_output_ids), req.cache_salt,
                      req.dp_rank if req.HasField("dp_rank") else -1)


class ProducerServicer(WorkerServicer):
    def __init__(self, bridge: EngineBridge, worker_id: str,
                 metrics: WorkerMetrics | None = None, cluster_token: str = "") -> None:
        super().__init__(bridge, worker_id, metrics, cluster_token)
        bridge.on_done = self._ended
        bridge.on_transfer = self._transferred

    def _ended(self, done: OutputsDone) -> None:
        """A StartPrefill request's last entry is queued on its Outputs stream."""
        if done.prefill:
            self._count("prefill", done.finish)

    def _transferred(self, result: TransferResultEvent) -> None:
        """A StartPrefill request's transfer result (the Prefill stream's are seen there)."""
        if result.ok and self.metrics is not None:
            self.metrics.kv_transfer.observe(result.kv_transfer_ms / 1e3)

    async def StartPrefill(self, request: worker_pb2.PrefillRequest,
                           context: grpc.aio.ServicerContext) -> worker_pb2.PrefillStarted:
        await self._check_token(context)
        rid = request.request_id
        wire = await self._admit("prefill", rid, request.prompt_token_ids, request.sampling,
                                 request.seed, context, request.prior_output_ids)
        await self._start_routed("prefill", rid, request.subscriber_id,
                                 "token 0 and the transfer's result",
                                 self.bridge.hub.attach_prefill,
                                 _prefill_cmd(request, wire, time.time_ns()), context)
        return worker_pb2.PrefillStarted()

    async def PrefillControl(self, request: worker_pb2.PrefillControlRequest,
                             context: grpc.aio.ServicerContext
                             ) -> worker_pb2.PrefillControlResponse:
        await self._check_token(context)
        rid = request.request_id
        kind = request.WhichOneof("kind")
        if kind is None:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                "kind: a destination or queued is required")
        if not self.bridge.hub.prefilling(rid):
            return worker_pb2.PrefillControlResponse(known=False)
        if kind == "destination":
            d = request.destination
            self.bridge.send(DestinationCmd(rid, d.consumer_id, d.kv_address,
                                            tuple(d.block_ids), d.cached_blocks))
        else:
            self.bridge.send(HoldCmd(rid, request.queued.consumer_id))
        return worker_pb2.PrefillControlResponse(known=True)

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
        wire = await self._admit("prefill", rid, req.prompt_token_ids, req.sampling, req.seed,
                                 context, req.prior_output_ids)
        sub = (await self._named_subscriber("prefill", req.subscriber_id, context)
               if req.subscriber_id else None)
        q = await self._open(rid, context)
        if sub is not None:
            self.bridge.hub.attach_token0(rid, sub)
        await self._start("prefill", rid, _prefill_cmd(req, wire, time.time_ns()), context)

        async def destinations() -> None:
            async for msg in request_iterator:
                if msg.WhichOneof("kind") == "destination":
                    d = msg.destination
                    self.bridge.send(DestinationCmd(rid, d.consumer_id, d.kv_address,
                                                    tuple(d.block_ids), d.cached_blocks))
                elif msg.WhichOneof("kind") == "queued":
                    self.bridge.send(HoldCmd(rid, msg.queued.consumer_id))

        reader = asyncio.create_task(destinations())
        done = False
        routed = False  # token 0 left on the Outputs stream (the result says so)
        outcome = "cancelled"
        try:
            while not done:
                msg = await q.get()
                if isinstance(msg, (Token0Event, Token0Routed)):
                    routed = isinstance(msg, Token0Routed)
                    t0ev = msg.event if isinstance(msg, Token0Routed) else msg
                    if not routed:  # not on an Outputs stream: here
                        out = worker_pb2.PrefillOutput()
                        fill_token0(out.token0, t0ev, time.time_ns())
                        yield out
                    # Only now may the final transfer notice leave for the consumer: token 0
                    # is ahead of the consumer's first decode step on every path. (On an
                    # Outputs stream it is queued, not yet written, and the bridge's pass
                    # that routed it has sent Token0SentCmd already; the consumer's tokens
                    # come a KV notice and a decode step later, and the router holds any
                    # that overtake it: router/requests/run_streams.py.)
                    if not routed:
                        self.bridge.send(Token0SentCmd(rid))
                    done = bool(t0ev.finish)
                    outcome = str(t0ev.finish or outcome)
                elif isinstance(msg, TransferResultEvent):
                    outcome = ("transferred" if msg.ok
                               else "busy" if msg.busy else "transfer_failed")
                    if msg.ok and self.metrics is not None:
                        self.metrics.kv_transfer.observe(msg.kv_transfer_ms / 1e3)
                    yield worker_pb2.PrefillOutput(transfer=worker_pb2.TransferResult(
                        ok=msg.ok, error=msg.error, kv_transfer_ms=msg.kv_transfer_ms,
                        busy=msg.busy, token0_routed=routed))
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
