"""Graceful drain of one worker, on SIGTERM or before a role change.

Lifecycle (worker/runner.py moves a worker through it):

    serving ──SIGTERM, or a role change the router ordered──▶ deregistered
        Membership.Deregister: the router stops placing new requests here; a call it placed
        just before may still be on the wire, so calls keep being served for IN_TRANSIT_S
    ──▶ closed: new Prefill/Decode/StartDecode calls end UNAVAILABLE ("... is draining"),
        Abort still works; the requests already running run to their end
    ──▶ drained, when no request runs                  [guard: --drain-timeout; past it,
        the requests still running end with an error naming the timeout: their own
        streams, and the Outputs streams that carry the others]
    ──▶ SIGTERM: Deregister(done), stop, exit 0 | role change: rebuild in the new role
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any

import grpc

from worker.registration import Registration
from worker.servicer import EngineBridge

log = logging.getLogger("pdserve.worker")
# Under the 30 s termination grace period of the Kubernetes manifests (deploy/k8s), which
# must exceed it: the worker still deregisters and stops its engine after the drain.
DEFAULT_DRAIN_TIMEOUT_S = 25.0
# Between the router placing a request and its call reaching us: a call placed before the
# router processed our Deregister arrives within this and is served, not refused.
IN_TRANSIT_S = 0.5
GATED_METHODS = ("/pdserve.v1.Worker/Prefill", "/pdserve.v1.Worker/Decode",
                 "/pdserve.v1.Worker/StartDecode")


class DrainGate(grpc.aio.ServerInterceptor):
    """Refuses new requests once closed; everything else (Abort, health) passes."""

    def __init__(self, worker_id: str = "") -> None:
        self.worker_id = worker_id
        self.reason = ""  # "": open

    def close(self, reason: str) -> None:
        self.reason = reason

    @property
    def message(self) -> str:
        return (f"worker {self.worker_id} is draining ({self.reason}): it takes no new "
                f"requests; retry on another worker")

    async def intercept_service(
        self, continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        if handler is None or not self.reason or handler_call_details.method not in GATED_METHODS:
            return handler
        return _refusing(handler, self.message)


def _refusing(handler: grpc.RpcMethodHandler, message: str) -> grpc.RpcMethodHandler:
    async def refuse(request: Any, context: grpc.aio.ServicerContext) -> None:
        await context.abort(grpc.StatusCode.UNAVAILABLE, message)

    kw = {"request_deserializer": handler.request_deserializer,
          "response_serializer": handler.response_serializer}
    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(refuse, **kw)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(refuse, **kw)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(refuse, **kw)
    return grpc.unary_unary_rpc_method_handler(refuse, **kw)


async def drain(bridge: EngineBridge, gate: DrainGate, registration: Registration | None,
                reason: str, timeout_s: float, *, deregister: bool = True) -> bool:
    """Runs the drain up to "drained". False: the timeout ended requests with an error.

    deregister=False when the router already stopped placing work here (it ordered a role
    change: the worker is draining in its registry since the order)."""
    # counted before the deregistration and its in-transit grace: a short request may end
    # inside those, and the count then shows what the drain found running when it began
    log.info("draining (%s): %d request(s) in flight at the start", reason, bridge.in_flight)
    if registration is not None:
        told = await registration.deregister(reason) if deregister else True
        registration.draining = True
        if told:
            await asyncio.sleep(IN_TRANSIT_S)
    gate.close(reason)
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout_s
    log.info("draining (%s): waiting for %d request(s) in flight (up to %g s)", reason,
             bridge.in_flight, timeout_s)
    while bridge.in_flight:
        if loop.time() >= end:
            log.warning("drain timeout (%g s): ending %d request(s) still running", timeout_s,
                        bridge.in_flight)
            bridge.fail_all(f"worker {gate.worker_id} stopped ({reason}): its drain timeout "
                            f"({timeout_s:g} s, --drain-timeout) passed before this request "
                            f"finished")
            await asyncio.sleep(0.2)  # the streams send their error before the server stops
            return False
        await asyncio.sleep(0.05)
    log.info("drained (%s)", reason)
    return True
