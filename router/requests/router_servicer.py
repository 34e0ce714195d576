"""The public ``pdserve.v1.Router`` service: what clients call."""

from __future__ import annotations

import contextlib
import time

import grpc
from pdserve.v1 import router_pb2, router_pb2_grpc

from router.requests.direct_write import DirectWrite, WriteFailed
from router.requests.errors import Overloaded, RequestError
from router.requests.frontend import Frontend


class RouterServicer(router_pb2_grpc.RouterServicer):
    def __init__(self, frontend: Frontend, policy_name: str) -> None:
        self.frontend = frontend
        self.dispatcher = frontend.dispatcher
        self.registry = frontend.registry
        self.model_id = frontend.model_id  # the name ListModels reports
        self.policy_name = policy_name

    async def Generate(self, request: router_pb2.GenerateRequest,  # type: ignore[override]
                       context: grpc.aio.ServicerContext) -> None:
        """Writes with ``context.write`` (not an async generator): a decoding request's
        tokens are written from the worker's batch as they come (``DirectWrite``); the rest
        (token 0, merged tokens, the final message) from here, in order."""
        received_ns = time.time_ns()
        writer = DirectWrite(context)
        try:
            async with contextlib.aclosing(self.frontend.generate(
                    request, received_ns, "grpc", direct=writer)) as responses:
                async for resp in responses:
                    await writer.send(resp)
            await writer.wait_idle()
        except WriteFailed:
            return  # the client's stream ended under a write: nobody left to tell
        except Overloaded as e:
            # The retry hint: seconds (like HTTP Retry-After), and the pushback gRPC's own
            # retry policy honours.
            await context.abort(e.code, e.message, trailing_metadata=(
                ("retry-after", f"{e.retry_after_s:g}"),
                ("grpc-retry-pushback-ms", str(int(e.retry_after_s * 1000)))))
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
                healthy=w.healthy, unhealthy_reason=w.unhealthy_reason,
                kv_fingerprint=w.kv_fingerprint, version=w.version, kv_address=w.kv_address,
                draining=w.draining, target_role=w.target_role,  # type: ignore[arg-type]
                tp_size=w.tp_size, outputs_address=w.outputs_address,
                outputs_unix=w.outputs_unix,
                outputs_transport=self.dispatcher.channels.outputs_transport(w.worker_id)))
        if request.include_requests:
            out.requests.extend(router_pb2.RequestStatus(
                request_id=r.request_id, state=r.state.name, age_s=r.age_s, producer=r.producer,
                consumer=r.consumer, colocated=r.colocated, tokens_streamed=r.tokens_streamed)
                for r in self.dispatcher.requests())
        return out
