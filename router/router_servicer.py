"""The public ``pdserve.v1.Router`` service: what clients call."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import grpc
from pdserve.v1 import router_pb2, router_pb2_grpc

from engine.tokenizer import Tokenizer
from router.dispatcher import Dispatcher, no_workers_message
from router.registry import Registry
from router.validation import RequestError, check_length, input_size, prepare

# Inputs larger than this are tokenized on a thread: a long prompt's chat template and
# BPE would otherwise hold the event loop, delaying other requests' token 0.
OFFLOOP_TOKENIZE_CHARS = 8192


class RouterServicer(router_pb2_grpc.RouterServicer):
    def __init__(self, dispatcher: Dispatcher, registry: Registry, tokenizer: Tokenizer,
                 model_id: str, model_names: set[str], policy_name: str,
                 max_tokens_limit: int) -> None:
        self.dispatcher = dispatcher
        self.registry = registry
        self.tokenizer = tokenizer
        self.model_id = model_id  # the name ListModels reports
        self.model_names = model_names  # every name GenerateRequest.model may use
        self.policy_name = policy_name
        self.max_tokens_limit = max_tokens_limit

    async def Generate(self, request: router_pb2.GenerateRequest,
                       context: grpc.aio.ServicerContext
                       ) -> AsyncIterator[router_pb2.GenerateResponse]:
        received_ns = time.time_ns()
        try:
            if input_size(request) > OFFLOOP_TOKENIZE_CHARS:
                prep = await asyncio.to_thread(prepare, request, self.tokenizer,
                                               self.model_names,
                                               max_tokens_limit=self.max_tokens_limit)
            else:
                prep = prepare(request, self.tokenizer, self.model_names,
                               max_tokens_limit=self.max_tokens_limit)
            if not self.registry.serving():
                raise RequestError(grpc.StatusCode.UNAVAILABLE, no_workers_message(self.registry))
            check_length(prep, self.registry.max_model_len())
            async for resp in self.dispatcher.generate(prep, received_ns):
                yield resp
        except RequestError as e:
            await context.abort(e.code, e.message)

    async def Abort(self, request: router_pb2.AbortRequest,
                    context: grpc.aio.ServicerContext) -> router_pb2.AbortResponse:
        return router_pb2.AbortResponse(ok=self.dispatcher.abort(request.request_id))

    async def ListModels(self, request: router_pb2.ListModelsRequest,
                         context: grpc.aio.ServicerContext) -> router_pb2.ListModelsResponse:
        return router_pb2.ListModelsResponse(models=[router_pb2.ModelInfo(
            id=self.model_id, max_model_len=self.registry.max_model_len())])

    async def ClusterStatus(self, request: router_pb2.ClusterStatusRequest,
                            context: grpc.aio.ServicerContext
                            ) -> router_pb2.ClusterStatusResponse:
        out = router_pb2.ClusterStatusResponse(policy=self.policy_name)
        for w in sorted(self.registry.all(), key=lambda w: w.worker_id):
            out.workers.append(router_pb2.WorkerStatus(
                worker_id=w.worker_id, role=w.role, address=w.address,  # type: ignore[arg-type]
                load=w.load, last_heartbeat_age_s=self.registry.heartbeat_age(w),
                healthy=w.healthy, unhealthy_reason=w.unhealthy_reason))
        return out
