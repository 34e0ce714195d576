"""The producer's gRPC face: Prefill streams token 0 and the transfer's outcome back to the
router, and forwards the consumer's destination to the engine process."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import grpc
from pdserve.v1 import worker_pb2

from worker.convert import finish_reason_pb, token_logprob
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
from worker.servicer import WorkerServicer


class ProducerServicer(WorkerServicer):
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
        q = await self._open(rid, context)
        received = time.time_ns()
        await self._start("prefill", rid,
                          PrefillCmd(rid, tuple(req.prompt_token_ids), wire, received,
                                     tuple(req.prior_output_ids), req.cache_salt,
                                     req.dp_rank if req.HasField("dp_rank") else -1), context)

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
                        sent_ns=time.time_ns(), cached_tokens=msg.cached_tokens)
                    if msg.logprob is not None:
                        t0.logprob.CopyFrom(token_logprob(msg.logprob))
                    yield worker_pb2.PrefillOutput(token0=t0)
                    # Only now may the final transfer notice leave for the consumer: token 0
                    # is ahead of the consumer's first decode step on every path.
                    self.bridge.send(Token0SentCmd(rid))
                    done = bool(msg.finish)
                    outcome = str(msg.finish or outcome)
                elif isinstance(msg, TransferResultEvent):
                    outcome = ("transferred" if msg.ok
                               else "busy" if msg.busy else "transfer_failed")
                    if msg.ok and self.metrics is not None:
                        self.metrics.kv_transfer.observe(msg.kv_transfer_ms / 1e3)
                    yield worker_pb2.PrefillOutput(transfer=worker_pb2.TransferResult(
                        ok=msg.ok, error=msg.error, kv_transfer_ms=msg.kv_transfer_ms,
                        busy=msg.busy))
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
