"""Joining the router: Register once the engine is ready, then heartbeat the load; register
again if the router forgot us (it restarted, or dropped us after missed heartbeats). With
each heartbeat, poll the router's orders (a role change it wants). Leaving: Deregister
(draining: no new work comes) and, once drained, Deregister(done). A worker whose engine
failed leaves at once (Deregister(done)) and never registers again: it serves nothing until
it restarts, and between the failure and its exit (the engine stops its TP ranks and
transfer endpoints first) the router would otherwise place new requests on it."""

from __future__ import annotations

import asyncio
import importlib.metadata
import logging
from collections.abc import Callable
from typing import Any

import grpc
from pdserve.v1 import common_pb2, router_pb2, router_pb2_grpc, worker_pb2, worker_pb2_grpc

log = logging.getLogger("pdserve.worker")
ROLES = {"producer": common_pb2.ROLE_PRODUCER, "consumer": common_pb2.ROLE_CONSUMER,
         "colocated": common_pb2.ROLE_COLOCATED}


def pdserve_version() -> str:
    try:
        return importlib.metadata.version("pdserve")
    except importlib.metadata.PackageNotFoundError:  # run from a source tree
        return "unknown"


def load_pb(load: dict[str, Any]) -> common_pb2.WorkerLoad:
    fields = common_pb2.WorkerLoad.DESCRIPTOR.fields_by_name
    return common_pb2.WorkerLoad(**{k: v for k, v in load.items() if k in fields})


class Registration:
    def __init__(self, router: str, worker_id: str, role: str, address: str,
                 info: dict[str, Any], load: Callable[[], dict[str, Any]],
                 cluster_token: str = "", router_ca: str = "",
                 failed: Callable[[], str | None] = lambda: None) -> None:
        if router_ca:  # the router serves TLS (--tls-cert): verify it with this CA
            with open(router_ca, "rb") as f:
                creds = grpc.ssl_channel_credentials(root_certificates=f.read())
            self.channel = grpc.aio.secure_channel(router, creds)
        else:
            self.channel = grpc.aio.insecure_channel(router)
        self.stub = worker_pb2_grpc.RegistryStub(self.channel)
        self.membership = router_pb2_grpc.MembershipStub(self.channel)
        self.worker_id = worker_id
        self.role = role
        self.address = address
        self.info = info
        self.load = load
        self.token = cluster_token
        self.interval = 1.0
        self.draining = False  # set once deregistered: never register again
        self.change_role = 0  # common_pb2.Role the router ordered (0: none)
        self.ordered = asyncio.Event()  # set when change_role is
        self.failed = failed  # why the engine failed (None while it serves)
        self.left = False  # told the router so (once)

    async def register(self) -> None:
        resp = await self.stub.Register(worker_pb2.RegisterRequest(
            worker_id=self.worker_id, role=ROLES[self.role], address=self.address,
            kv_address=self.info.get("kv_address", ""), model=self.info["model"],
            kv_fingerprint=self.info["kv_fingerprint"],
            max_model_len=self.info["max_model_len"], load=load_pb(self.load()),
            cluster_token=self.token, tp_size=int(self.info.get("tp_size", 1)),
            lease_s=float(self.info.get("lease_s", 0.0)),
            version=pdserve_version()), timeout=10)
        self.interval = resp.heartbeat_interval_s or 1.0
        log.info("registered with the router as %s (%s)", self.worker_id, self.role)

    async def run(self) -> None:
        """Registers (retrying while the router is not up) and heartbeats forever."""
        registered = False
        while True:
            if (why := self.failed()) is not None:
                # No heartbeat (it would keep this worker placeable) and no register (after
                # the router dropped it for its failed requests, that would bring it back as
                # a new registration, which the requests that failed here do not exclude).
                if not self.left:
                    self.left = True
                    log.warning("engine failed: leaving the router (%s)", why)
                    await self.deregister(f"engine failed: {why}", done=True)
                await asyncio.sleep(self.interval)
                continue
            try:
                if not registered and not self.draining:
                    await self.register()
                    registered = True
                elif registered:
                    resp = await self.stub.Heartbeat(worker_pb2.HeartbeatRequest(
                        worker_id=self.worker_id, load=load_pb(self.load()),
                        cluster_token=self.token), timeout=5)
                    registered = resp.known
                    if registered and not self.ordered.is_set():
                        await self._poll_orders()
            except grpc.aio.AioRpcError as e:
                if e.code() in (grpc.StatusCode.UNAUTHENTICATED,
                                grpc.StatusCode.INVALID_ARGUMENT,
                                grpc.StatusCode.FAILED_PRECONDITION):
                    raise RuntimeError(f"the router refused this worker: {e.details()}") from e
                log.warning("router unreachable (%s); retrying", e.code().name)
                registered = False
            await asyncio.sleep(self.interval)

    async def _poll_orders(self) -> None:
        try:
            resp = await self.membership.Orders(router_pb2.OrdersRequest(
                worker_id=self.worker_id, cluster_token=self.token), timeout=5)
        except grpc.aio.AioRpcError as e:
            # not a reason to register again (an older router has no Membership service);
            # the heartbeat says whether the router still knows us
            log.debug("orders poll failed: %s", e.code().name)
            return
        if resp.change_role and resp.change_role in ROLES.values():
            self.change_role = resp.change_role
            self.ordered.set()

    async def deregister(self, reason: str, done: bool = False, timeout: float = 5.0) -> bool:
        """Tells the router to stop sending work (done: to forget this worker). False when
        the router could not be told (gone, or did not know us): nothing to wait for then."""
        self.draining = True
        try:
            resp = await self.membership.Deregister(router_pb2.DeregisterRequest(
                worker_id=self.worker_id, cluster_token=self.token, done=done, reason=reason),
                timeout=timeout)
        except grpc.aio.AioRpcError as e:
            log.warning("could not deregister from the router (%s): %s", e.code().name,
                        e.details())
            return False
        return bool(resp.known)

    async def close(self) -> None:
        await self.channel.close()
