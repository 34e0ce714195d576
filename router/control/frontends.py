"""Several front-door processes on the same ports (``pdserve router --frontends N``).

One Python process serves about one core's worth of streamed tokens; a GPU cluster makes
more. With ``--frontends N`` the router process (the *primary*) starts N - 1 more router
processes (*mirrors*) bound to the same gRPC and HTTP ports (SO_REUSEPORT: the kernel
spreads new connections over them). Each one runs its own requests end to end (tokenizing,
placing, the legs, streaming to its clients), so token throughput grows with cores.

One view of the workers: the primary alone keeps the registry. Workers reach whichever
process accepted their connection, so a mirror forwards every Registry, Membership and Admin
call to the primary (over the primary's own loopback port) and mirrors its registry from
``Membership.Watch``: the whole view at once, then again on every change and at least every
``WATCH_INTERVAL_S``. A worker the primary drops leaves every mirror with the next view (its
requests there fail over as on the primary); a mirror whose primary is gone stops hearing
of heartbeats, so its own sweep drops the workers within the heartbeat timeout, and the
mirror exits (its parent is gone). Placement stays load-aware everywhere: the load each
worker reports reaches every mirror with the view; what a mirror does not see is the other
frontends' requests placed since the last heartbeat.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import weakref
from collections.abc import AsyncIterator
from typing import Any

import grpc
from pdserve.v1 import router_pb2, router_pb2_grpc, worker_pb2_grpc

from router.control.registry import Registry, WorkerInfo
from router.control.registry_servicer import MembershipServicer, authenticate

log = logging.getLogger(__name__)
WATCH_INTERVAL_S = 0.2  # a mirror's view is at most this stale (plus the transit)
FORWARD_TIMEOUT_S = 10.0


# -- the primary ---------------------------------------------------------------------------

class PrimaryMembership(MembershipServicer):
    """Membership plus Watch: the registry, streamed to the mirrors."""

    def __init__(self, registry: Registry, cluster_token: str) -> None:
        super().__init__(registry, cluster_token)
        self._changed = asyncio.Event()
        registry.on_change.append(self._changed.set)
        self._incarnations: weakref.WeakKeyDictionary[WorkerInfo, int] = \
            weakref.WeakKeyDictionary()
        self._next = 1

    def view(self) -> router_pb2.RegistryView:
        out = router_pb2.RegistryView()
        for w in self.registry.all():
            if w not in self._incarnations:  # a new WorkerInfo: a new registration
                self._incarnations[w] = self._next
                self._next += 1
            out.workers.add(
                worker_id=w.worker_id, role=w.role, address=w.address,  # type: ignore[arg-type]
                kv_address=w.kv_address, model=w.model, kv_fingerprint=w.kv_fingerprint,
                max_model_len=w.max_model_len, load=w.load, version=w.version,
                tp_size=w.tp_size, dp_size=w.dp_size, draining=w.draining,
                drain_reason=w.drain_reason, outputs_address=w.outputs_address,
                outputs_unix=w.outputs_unix,
                target_role=w.target_role,  # type: ignore[arg-type]
                incarnation=self._incarnations[w])
        return out

    async def Watch(self, request: router_pb2.WatchRequest,
                    context: grpc.aio.ServicerContext) -> AsyncIterator[router_pb2.RegistryView]:
        await authenticate(self.cluster_token, request.cluster_token, "a router frontend",
                           context)
        while True:
            self._changed.clear()
            yield self.view()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._changed.wait(), WATCH_INTERVAL_S)


# -- a mirror ------------------------------------------------------------------------------

class RegistryMirror:
    """Keeps a mirror's registry equal to the primary's last view."""

    def __init__(self, registry: Registry, primary: grpc.aio.Channel, cluster_token: str
                 ) -> None:
        self.registry = registry
        self.stub = router_pb2_grpc.MembershipStub(primary)
        self.token = cluster_token
        self.views = 0  # views applied (tests)
        self._known: dict[str, int] = {}  # worker id -> incarnation mirrored

    async def run(self) -> None:
        while True:
            try:
                async for view in self.stub.Watch(router_pb2.WatchRequest(
                        cluster_token=self.token)):
                    self.apply(view)
            except grpc.aio.AioRpcError as e:
                log.warning("frontend: the primary router's registry is unreachable (%s); "
                            "retrying", e.code().name)
            await asyncio.sleep(0.5)

    def apply(self, view: router_pb2.RegistryView) -> None:
        reg = self.registry
        seen = set()
        for v in view.workers:
            seen.add(v.worker_id)
            if self._known.get(v.worker_id) != v.incarnation or reg.get(v.worker_id) is None:
                self._known[v.worker_id] = v.incarnation
                reg.register(worker_id=v.worker_id, role=v.role, address=v.address,
                             kv_address=v.kv_address, model=v.model,
                             kv_fingerprint=v.kv_fingerprint, max_model_len=v.max_model_len,
                             load=v.load, version=v.version, tp_size=v.tp_size or 1,
                             dp_size=v.dp_size or 1, outputs_address=v.outputs_address,
                             outputs_unix=v.outputs_unix)
            else:
                reg.heartbeat(v.worker_id, v.load)
            w = reg.get(v.worker_id)
            if w is not None:
                if v.draining and not w.draining:
                    reg.drain(v.worker_id, v.drain_reason)
                w.target_role = v.target_role
        for worker_id in [w.worker_id for w in reg.all() if w.worker_id not in seen]:
            self._known.pop(worker_id, None)
            reg.remove(worker_id, f"worker {worker_id} left the primary router's registry")
        self.views += 1


class RegistryProxy(worker_pb2_grpc.RegistryServicer):
    """A worker's Register/Heartbeat, reaching a mirror, goes on to the primary."""

    def __init__(self, primary: grpc.aio.Channel) -> None:
        self.stub = worker_pb2_grpc.RegistryStub(primary)

    async def Register(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        return await _forward(self.stub.Register, request, context)

    async def Heartbeat(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        return await _forward(self.stub.Heartbeat, request, context)

    async def PublishKVEvents(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        # the index lives in the primary (a mirror places by load alone)
        return await _forward(self.stub.PublishKVEvents, request, context)


class MembershipProxy(router_pb2_grpc.MembershipServicer):
    def __init__(self, primary: grpc.aio.Channel) -> None:
        self.stub = router_pb2_grpc.MembershipStub(primary)

    async def Deregister(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        return await _forward(self.stub.Deregister, request, context)

    async def Orders(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        return await _forward(self.stub.Orders, request, context)

    async def Watch(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                            "Watch: this router is a mirror; watch the primary")


class AdminProxy(router_pb2_grpc.AdminServicer):
    def __init__(self, primary: grpc.aio.Channel) -> None:
        self.stub = router_pb2_grpc.AdminStub(primary)

    async def ChangeSplit(self, request: Any, context: grpc.aio.ServicerContext
                          ) -> AsyncIterator[router_pb2.ChangeSplitProgress]:
        try:
            async for msg in self.stub.ChangeSplit(request, metadata=_metadata(context)):
                yield msg
        except grpc.aio.AioRpcError as e:
            await context.abort(e.code(), e.details() or "")


def _metadata(context: grpc.aio.ServicerContext) -> tuple[tuple[str, str], ...]:
    """The caller's metadata, minus what gRPC sets itself: the primary checks the same API
    key (or cluster token) the caller sent here."""
    return tuple((k, v) for k, v in (context.invocation_metadata() or ())
                 if isinstance(v, str) and not k.startswith((":", "grpc-"))
                 and k not in ("user-agent", "content-type", "te"))


async def _forward(method: Any, request: Any, context: grpc.aio.ServicerContext) -> Any:
    try:
        return await method(request, timeout=FORWARD_TIMEOUT_S, metadata=_metadata(context))
    except grpc.aio.AioRpcError as e:
        await context.abort(e.code(), e.details() or "")
