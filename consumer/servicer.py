"""The consumer's gRPC face (also the colocated worker's): a request's reservation, tokens
and end go to the router either on the router's Outputs stream (StartDecode: the call
only starts the request) or on the request's own stream (Decode)."""

from __future__ import annotations

from collections.abc import AsyncIterator

import grpc
from pdserve.v1 import common_pb2, worker_pb2

from engine.sampling_params import SamplingParams
from worker.convert import tokens_pb
from worker.messages import AbortCmd, DecodeCmd, FatalEvent, ReservedEvent
from worker.metrics_server import WorkerMetrics
from worker.output_hub import OutputsDone
from worker.servicer import EngineBridge, WorkerServicer
from worker.token_batch import TokensEvent


def _decode_cmd(request: worker_pb2.DecodeRequest, sampling: SamplingParams) -> DecodeCmd:
    return DecodeCmd(request.request_id, tuple(request.prompt_token_ids), sampling,
                     request.colocated, tuple(request.prior_output_ids),
                     request.source_tp_size, request.cache_salt, request.reuse_cached,
                     request.dp_rank if request.HasField("dp_rank") else -1)


class ConsumerServicer(WorkerServicer):
    def __init__(self, bridge: EngineBridge, worker_id: str,
                 metrics: WorkerMetrics | None = None, cluster_token: str = "") -> None:
        super().__init__(bridge, worker_id, metrics, cluster_token)
        bridge.on_done = self._ended

    def _ended(self, done: OutputsDone) -> None:
        """A StartDecode request's last tokens are queued on its Outputs stream."""
        self._count("decode", done.finish)

    async def StartDecode(self, request: worker_pb2.DecodeRequest,
                          context: grpc.aio.ServicerContext) -> worker_pb2.DecodeStarted:
        await self._check_token(context)
        rid = request.request_id
        wire = await self._admit("decode", rid, request.prompt_token_ids, request.sampling,
                                 request.seed, context, request.prior_output_ids)
        await self._start_routed("decode", rid, request.subscriber_id, "the request's outputs",
                                 self.bridge.hub.attach, _decode_cmd(request, wire), context)
        return worker_pb2.DecodeStarted()

    async def Decode(self, request: worker_pb2.DecodeRequest,
                     context: grpc.aio.ServicerContext) -> AsyncIterator[worker_pb2.DecodeOutput]:
        await self._check_token(context)
        rid = request.request_id
        wire = await self._admit("decode", rid, request.prompt_token_ids, request.sampling,
                                 request.seed, context, request.prior_output_ids)
        if request.subscriber_id:
            self._count("decode", "invalid")
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                "subscriber_id: must be empty on Decode (its own stream carries "
                                "the outputs); StartDecode sends them to an Outputs stream")
        q = await self._open(rid, context)
        await self._start("decode", rid, _decode_cmd(request, wire), context)
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
                elif isinstance(msg, FatalEvent):
                    outcome = "engine_failed"
                    await context.abort(grpc.StatusCode.UNAVAILABLE, msg.error)
        finally:
            self._count("decode", outcome)
            self.bridge.close_request(rid)
            if not done:
                self.bridge.send(AbortCmd(rid))
