"""The router's worker-facing services: ``pdserve.v1.Registry`` (workers join and report
load) and ``pdserve.v1.Membership`` (workers leave cleanly, and poll for role changes). Both
authenticate the caller with the cluster token."""

from __future__ import annotations

import hmac
import logging

import grpc
from pdserve.v1 import router_pb2, router_pb2_grpc, worker_pb2, worker_pb2_grpc

from router.control.kv_index import KVEventError, KVIndex
from router.control.registry import RegistrationError, Registry

log = logging.getLogger(__name__)

# A producer's --lease must outlast this many of the router's --hold-interval: the holds keep
# a backpressured request's blocks alive, and one hold late or lost must not free them.
LEASE_HOLDS = 2


class RegistryServicer(worker_pb2_grpc.RegistryServicer):
    def __init__(self, registry: Registry, heartbeat_interval_s: float,
                 cluster_token: str, hold_interval_s: float = 0.0,
                 kv_index: KVIndex | None = None) -> None:
        self.registry = registry
        self.kv_index = kv_index  # None: this router keeps no index (events unanswered)
        self.heartbeat_interval_s = heartbeat_interval_s
        self.cluster_token = cluster_token
        self.hold_interval_s = hold_interval_s  # 0: the lease is not checked

    async def Register(self, request: worker_pb2.RegisterRequest,
                       context: grpc.aio.ServicerContext) -> worker_pb2.RegisterResponse:
        await self._authenticate(request.cluster_token, request.worker_id, context)
        try:
            self._check_lease(request)
            w = self.registry.register(
                worker_id=request.worker_id, role=request.role, address=request.address,
                kv_address=request.kv_address, model=request.model,
                kv_fingerprint=request.kv_fingerprint, max_model_len=request.max_model_len,
                load=request.load if request.HasField("load") else None,
                version=request.version, tp_size=request.tp_size or 1,
                block_size=request.block_size, prefix_caching=request.prefix_caching,
                accepts_cache_salt=request.accepts_cache_salt, dp_size=request.dp_size or 1,
                outputs_address=request.outputs_address, outputs_unix=request.outputs_unix)
        except RegistrationError as e:
            log.warning("refused worker %r: %s", request.worker_id, e)
            code = (grpc.StatusCode.FAILED_PRECONDITION if e.precondition
                    else grpc.StatusCode.INVALID_ARGUMENT)
            await context.abort(code, str(e))
            raise  # unreachable: abort raises; keeps type checkers honest
        log.info("registered %s %s at %s (max_model_len %d)", w.role_name, w.worker_id,
                 w.address, w.max_model_len)
        return worker_pb2.RegisterResponse(heartbeat_interval_s=self.heartbeat_interval_s)

    def _check_lease(self, request: worker_pb2.RegisterRequest) -> None:
        lease, least = request.lease_s, LEASE_HOLDS * self.hold_interval_s
        if lease and least and not lease >= least:  # "not >=": a NaN lease is refused too
            raise RegistrationError(
                f"lease_s: worker {request.worker_id}'s --lease ({lease:g} s) is under "
                f"{LEASE_HOLDS}x this router's --hold-interval ({self.hold_interval_s:g} s): as "
                f"a producer it would free the blocks of a request waiting for a consumer "
                f"between two of the router's holds; raise the worker's --lease or lower the "
                f"router's --hold-interval", precondition=True)

    async def Heartbeat(self, request: worker_pb2.HeartbeatRequest,
                        context: grpc.aio.ServicerContext) -> worker_pb2.HeartbeatResponse:
        await self._authenticate(request.cluster_token, request.worker_id, context)
        w = self.registry.get(request.worker_id)
        was = self.registry.busy_reason(w) if w is not None else ""
        known = self.registry.heartbeat(request.worker_id,
                                        request.load if request.HasField("load") else None)
        if known and w is not None and bool(now := self.registry.busy_reason(w)) != bool(was):
            if now:
                log.warning("%s %s is busy: %s; no new requests go to it until it catches "
                            "up, it keeps those it runs", w.role_name, w.worker_id, now)
            else:
                log.info("%s %s caught up: it takes new requests again", w.role_name,
                         w.worker_id)
        return worker_pb2.HeartbeatResponse(
            known=known,
            change_role=self.registry.orders(request.worker_id) if known else 0)  # type: ignore[arg-type]

    async def PublishKVEvents(self, request: worker_pb2.KVEventBatch,
                              context: grpc.aio.ServicerContext) -> worker_pb2.KVEventAck:
        await self._authenticate(request.cluster_token, request.worker_id, context)
        if self.kv_index is None:
            await context.abort(grpc.StatusCode.UNIMPLEMENTED, "this router keeps no KV index")
            raise AssertionError  # unreachable: abort raises
        try:
            got = self.kv_index.apply(self.registry.get(request.worker_id), request)
        except KVEventError as e:
            log.warning("worker %r sent bad KV events: %s", request.worker_id, e)
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
            raise AssertionError from e  # unreachable: abort raises
        return worker_pb2.KVEventAck(known=got.known, resync=got.resync)

    async def _authenticate(self, token: str, worker_id: str,
                            context: grpc.aio.ServicerContext) -> None:
        await authenticate(self.cluster_token, token, worker_id, context)


class MembershipServicer(router_pb2_grpc.MembershipServicer):
    def __init__(self, registry: Registry, cluster_token: str) -> None:
        self.registry = registry
        self.cluster_token = cluster_token

    async def Deregister(self, request: router_pb2.DeregisterRequest,
                         context: grpc.aio.ServicerContext) -> router_pb2.DeregisterResponse:
        await authenticate(self.cluster_token, request.cluster_token, request.worker_id, context)
        w = self.registry.get(request.worker_id)
        if w is None:
            return router_pb2.DeregisterResponse(known=False)
        reason = request.reason or "deregistered"
        if request.done:
            log.info("%s %s left (%s)", w.role_name, w.worker_id, reason)
            self.registry.leave(w.worker_id, reason)
        else:
            log.info("%s %s draining (%s): no new requests go to it", w.role_name,
                     w.worker_id, reason)
            self.registry.drain(w.worker_id, reason)
        return router_pb2.DeregisterResponse(known=True)

    async def Orders(self, request: router_pb2.OrdersRequest,
                     context: grpc.aio.ServicerContext) -> router_pb2.OrdersResponse:
        await authenticate(self.cluster_token, request.cluster_token, request.worker_id, context)
        return router_pb2.OrdersResponse(
            change_role=self.registry.orders(request.worker_id))  # type: ignore[arg-type]


async def authenticate(expected: str, token: str, worker_id: str,
                       context: grpc.aio.ServicerContext) -> None:
    if not expected:
        return
    # Constant-time: the token is the only thing keeping strangers out of the pools.
    if not hmac.compare_digest(token.encode(), expected.encode()):
        log.warning("worker %r sent a wrong cluster token", worker_id)
        await context.abort(grpc.StatusCode.UNAUTHENTICATED,
                            "cluster_token: does not match the router's --cluster-token")
