"""The internal ``pdserve.v1.Registry`` service: workers join and report load."""

from __future__ import annotations

import hmac
import logging

import grpc
from pdserve.v1 import worker_pb2, worker_pb2_grpc

from router.registry import RegistrationError, Registry

log = logging.getLogger(__name__)


class RegistryServicer(worker_pb2_grpc.RegistryServicer):
    def __init__(self, registry: Registry, heartbeat_interval_s: float,
                 cluster_token: str) -> None:
        self.registry = registry
        self.heartbeat_interval_s = heartbeat_interval_s
        self.cluster_token = cluster_token

    async def Register(self, request: worker_pb2.RegisterRequest,
                       context: grpc.aio.ServicerContext) -> worker_pb2.RegisterResponse:
        await self._authenticate(request.cluster_token, request.worker_id, context)
        try:
            w = self.registry.register(
                worker_id=request.worker_id, role=request.role, address=request.address,
                kv_address=request.kv_address, model=request.model,
                kv_fingerprint=request.kv_fingerprint, max_model_len=request.max_model_len,
                load=request.load if request.HasField("load") else None)
        except RegistrationError as e:
            log.warning("refused worker %r: %s", request.worker_id, e)
            code = (grpc.StatusCode.FAILED_PRECONDITION if e.precondition
                    else grpc.StatusCode.INVALID_ARGUMENT)
            await context.abort(code, str(e))
            raise  # unreachable: abort raises; keeps type checkers honest
        log.info("registered %s %s at %s (max_model_len %d)", w.role_name, w.worker_id,
                 w.address, w.max_model_len)
        return worker_pb2.RegisterResponse(heartbeat_interval_s=self.heartbeat_interval_s)

    async def Heartbeat(self, request: worker_pb2.HeartbeatRequest,
                        context: grpc.aio.ServicerContext) -> worker_pb2.HeartbeatResponse:
        await self._authenticate(request.cluster_token, request.worker_id, context)
        known = self.registry.heartbeat(request.worker_id,
                                        request.load if request.HasField("load") else None)
        return worker_pb2.HeartbeatResponse(known=known)

    async def _authenticate(self, token: str, worker_id: str,
                            context: grpc.aio.ServicerContext) -> None:
        if not self.cluster_token:
            return
        # Constant-time: the token is the only thing keeping strangers out of the pools.
        if not hmac.compare_digest(token.encode(), self.cluster_token.encode()):
            log.warning("worker %r sent a wrong cluster token", worker_id)
            await context.abort(grpc.StatusCode.UNAUTHENTICATED,
                                "cluster_token: does not match the router's --cluster-token")
