"""The consumer's gRPC face (also the colocated worker's): Decode streams the reservation,
then tokens, back to the router."""

from __future__ import annotations

from collections.abc import AsyncIterator

import grpc
from pdserve.v1 import common_pb2, worker_pb2

from worker.convert import tokens_pb
from worker.messages import AbortCmd, DecodeCmd, FatalEvent, ReservedEvent, TokensEvent
from worker.output_hub import OutputsDone
from worker.servicer import WorkerServicer


class ConsumerServicer(WorkerServicer):
    async def Decode(self, request: worker_pb2.DecodeRequest,
                     context: grpc.aio.ServicerContext) -> AsyncIterator[worker_pb2.DecodeOutput]:
        await self._check_token(context)
        rid = request.request_id
        wire = await self._admit("decode", rid, request.prompt_token_ids, request.sampling,
                                 request.seed, context, request.prior_output_ids)
        q = await self._open(rid, context)
        if request.subscriber_id:
            sub = await self.bridge.hub.wait_for(request.subscriber_id)
            if sub is None or sub.closed:
                self.bridge.close_request(rid)
                self._count("decode", "invalid")
                await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                    f"subscriber_id: no Outputs stream {request.subscriber_id!r}"
                                    " is open on this worker")
                return
            self.bridge.hub.attach(rid, sub)
        await self._start("decode", rid, DecodeCmd(rid, tuple(request.prompt_token_ids), wire,
                                                   request.colocated,
                                                   tuple(request.prior_output_ids),
                                                   request.source_tp_size, request.cache_salt,
                                                   request.reuse_cached,
                                                   request.dp_rank
                                                   if request.HasField("dp_rank") else -1),
                          context)
        done = False
        outcome = "cancelled"
        try:
            while not done:
                msg = await q.get()
                if isinstance(msg, ReservedEvent):
                    yield worker_pb2.DecodeOutput(reserved=worker_pb2.Reserved(
                        kv_address=msg.kv_address, block_ids=msg.block_ids,
                        cached_blocks=msg.cached_blocks))
                elif isinstance(msg, TokensEvent):
                    t = tokens_pb(msg)
                    done = t.finish_reason != common_pb2.FINISH_REASON_UNSPECIFIED
                    if done:
                        outcome = str(msg.finish)
                    yield worker_pb2.DecodeOutput(tokens=t)
                elif isinstance(msg, OutputsDone):  # its last tokens went out in that batch
                    done = True
                    outcome = str(msg.finish)
                    yield worker_pb2.DecodeOutput(done=worker_pb2.DecodeDone(final_seq=msg.seq))
                elif isinstance(msg, FatalEvent):
                    outcome = "engine_failed"
                    await context.abort(grpc.StatusCode.UNAVAILABLE, msg.error)
        finally:
            self._count("decode", outcome)
            self.bridge.close_request(rid)
            if not done:
                self.bridge.send(AbortCmd(rid))
