"""The router process in one object: ``await RouterServer(cfg).start()`` -> bound port.

Wires registry, policy, channels, dispatcher and the gRPC services (Router, Admin,
Registry, Membership, standard health, reflection) onto one grpc.aio server, and runs the
heartbeat sweep.
Health is SERVING exactly while a request could be placed (``Registry.serving``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Coroutine
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio  # type: ignore[attr-defined]
from grpc_reflection.v1alpha import reflection
from pdserve.v1 import router_pb2, router_pb2_grpc, worker_pb2, worker_pb2_grpc

from engine.model_source import model_display_name, resolve_model
from engine.tokenizer import Tokenizer
from router.auth import ApiKeyInterceptor, grpc_server_credentials
from router.config import RouterConfig
from router.control.admin_servicer import AdminServicer
from router.control.frontends import (
    AdminProxy,
    MembershipProxy,
    PrimaryMembership,
    RegistryMirror,
    RegistryProxy,
)
from router.control.kv_index import KVIndex
from router.control.policy import make_policy
from router.control.registry import Registry
from router.control.registry_servicer import RegistryServicer
from router.control.role_change import RoleChanger
from router.requests.admission import Admission
from router.requests.channels import WorkerChannels
from router.requests.dispatcher import Dispatcher
from router.requests.frontend import Frontend
from router.requests.metrics import RouterMetrics
from router.requests.router_servicer import RouterServicer

log = logging.getLogger(__name__)

ROUTER_SERVICE = router_pb2.DESCRIPTOR.services_by_name["Router"].full_name
ADMIN_SERVICE = router_pb2.DESCRIPTOR.services_by_name["Admin"].full_name
MEMBERSHIP_SERVICE = router_pb2.DESCRIPTOR.services_by_name["Membership"].full_name
REGISTRY_SERVICE = worker_pb2.DESCRIPTOR.services_by_name["Registry"].full_name
# A sweep tick this late is a stall worth a log line (lateness under it is still credited).
STALL_LOG_S = 1.0
SERVER_OPTIONS = [
    ("grpc.max_send_message_length", 64 << 20),
    ("grpc.max_receive_message_length", 64 << 20),
]


def host_port(host: str, port: int) -> str:
    if ":" in host and not host.startswith("["):  # IPv6 literal
        host = f"[{host}]"
    return f"{host}:{port}"


class RouterServer:
    def __init__(self, config: RouterConfig, tokenizer: Tokenizer | None = None) -> None:
        self.config = config
        self._tokenizer = tokenizer  # tests may pass one to skip loading
        self.registry: Registry | None = None
        self.dispatcher: Dispatcher | None = None
        self.port = 0
        self.http_port = 0  # bound HTTP port once started (0: HTTP is off)
        self.metrics: RouterMetrics | None = None
        self.admission: Admission | None = None
        self._http: Any = None  # router.http.http_server.HttpFrontDoor, imported only when used
        self.grpc_stream_port = 0  # bound hand-framed Generate port once started (0: off)
        self._grpc_stream: Any = None  # router.grpc_stream.door.GrpcStreamDoor, when on
        self._server: grpc.aio.Server | None = None
        self._health: health_aio.HealthServicer | None = None
        self._channels: WorkerChannels | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self.role_changer: RoleChanger | None = None
        self._frontend: Frontend | None = None
        self.internal_address = ""  # the primary's loopback address (--frontends > 1)
        self.mirror: RegistryMirror | None = None  # set in a mirror frontend
        self._primary: grpc.aio.Channel | None = None

    @property
    def address(self) -> str:
        """What clients and workers dial (the advertised host)."""
        return host_port(self.config.host, self.port)

    async def start(self) -> int:
        cfg = self.config
        path = resolve_model(cfg.model)
        model_id = model_display_name(path)
        tokenizer = self._tokenizer
        if tokenizer is None:
            tokenizer = await asyncio.to_thread(Tokenizer.from_source, path)
        self.registry = Registry(heartbeat_timeout_s=cfg.heartbeat_timeout_s,
                                 served_model=model_id, busy_lag_s=cfg.busy_lag_s,
                                 busy_engine_s=cfg.busy_engine_s)
        self._channels = WorkerChannels(close_delay_s=cfg.abort_timeout_s + 1.0,
                                        cluster_token=cfg.cluster_token)
        policy = make_policy(cfg.policy, cfg.cache_load_tokens, cfg.cache_imbalance)
        # fed by the workers' KV events (in the primary; a mirror's stays empty)
        self.kv_index = KVIndex()
        self.registry.on_drop.append(lambda w, _why: self.kv_index.forget(w))
        self.dispatcher = Dispatcher(self.registry, policy, self._channels, cfg,
                                     self.kv_index)
        names = {model_id, path} | ({cfg.model} if cfg.model else set())

        self.admission = Admission(cfg.max_running_requests, cfg.max_queued_requests,
                                   cfg.retry_after_s)
        self.metrics = RouterMetrics(self.registry, self.admission, self.dispatcher)
        frontend = Frontend(self.dispatcher, self.registry, tokenizer, model_id, names,
                            cfg.max_tokens_limit, self.admission, self.metrics,
                            tokenizer_source=path)
        self._frontend = frontend
        # Admin changes the cluster's shape: at least the key that guards generation.
        interceptors = ([ApiKeyInterceptor(cfg.api_key, {ROUTER_SERVICE, ADMIN_SERVICE})]
                        if cfg.api_key else [])
        server = grpc.aio.server(options=SERVER_OPTIONS, interceptors=interceptors)
        router_pb2_grpc.add_RouterServicer_to_server(RouterServicer(frontend, policy.name),
                                                     server)
        self.role_changer = RoleChanger(self.registry)
        if cfg.primary:  # a mirror frontend: the primary keeps the registry
            self._primary = grpc.aio.insecure_channel(cfg.primary)
            worker_pb2_grpc.add_RegistryServicer_to_server(RegistryProxy(self._primary), server)
            router_pb2_grpc.add_MembershipServicer_to_server(MembershipProxy(self._primary),
                                                             server)
            router_pb2_grpc.add_AdminServicer_to_server(AdminProxy(self._primary), server)
            self.mirror = RegistryMirror(self.registry, self._primary, cfg.cluster_token)
        else:
            worker_pb2_grpc.add_RegistryServicer_to_server(
                RegistryServicer(self.registry, cfg.heartbeat_interval_s, cfg.cluster_token,
                                 cfg.hold_interval_s, self.kv_index),
                server)
            router_pb2_grpc.add_MembershipServicer_to_server(
                PrimaryMembership(self.registry, cfg.cluster_token), server)
            router_pb2_grpc.add_AdminServicer_to_server(
                AdminServicer(self.registry, self.role_changer), server)
        self._health = health_aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self._health, server)
        reflection.enable_server_reflection(
            [ROUTER_SERVICE, ADMIN_SERVICE, MEMBERSHIP_SERVICE, REGISTRY_SERVICE,
             health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
             reflection.SERVICE_NAME], server)
        bind = host_port(cfg.listen_host, cfg.grpc_port)
        try:
            if cfg.tls_cert:
                self.port = server.add_secure_port(
                    bind, grpc_server_credentials(cfg.tls_cert, cfg.tls_key))
            else:
                self.port = server.add_insecure_port(bind)
        except RuntimeError as e:
            raise ValueError(f"--grpc-port: cannot bind {bind}: {e}") from e
        if not self.port:
            raise ValueError(f"--grpc-port: cannot bind {bind}")
        if cfg.frontends > 1:  # where the mirrors reach this process alone (frontends.py)
            self.internal_address = f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}"
        await server.start()
        self._server = server
        await self._set_health()
        self.registry.on_change.append(self._health_changed)
        self._spawn(self._sweep())
        if self.mirror is not None:
            self._spawn(self.mirror.run())
        if cfg.http_port >= 0:
            from router.http.http_server import HttpFrontDoor  # aiohttp only when HTTP is on

            self._http = HttpFrontDoor(frontend, self.metrics, cfg)
            try:
                self.http_port = await self._http.start()
            except BaseException:
                await self.stop(0)
                raise
        if cfg.grpc_stream_port >= 0:
            from router.grpc_stream.door import GrpcStreamDoor  # h2 only when it is on

            self._grpc_stream = GrpcStreamDoor(frontend, cfg, dict(SERVER_OPTIONS)[
                "grpc.max_receive_message_length"])
            try:
                self.grpc_stream_port = await self._grpc_stream.start()
            except BaseException:
                await self.stop(0)
                raise
        log.info("router serving %s on %s (policy %s)%s", model_id, self.address, policy.name,
                 f", HTTP on port {self.http_port}" if self.http_port else "")
        return self.port

    async def stop(self, grace: float = 1.0) -> None:
        for t in list(self._tasks):
            t.cancel()
            with contextlib.suppress(BaseException):
                await t
        if self.role_changer is not None:
            await self.role_changer.close()
        if self._grpc_stream is not None:  # GOAWAY first: its open streams end below
            self._grpc_stream.goaway()
        if self._health is not None:
            await self._health.enter_graceful_shutdown()
        if self.dispatcher is not None:
            await self.dispatcher.close()
        if self._http is not None:  # after the dispatcher ended its runs: streams close fast
            await self._http.stop()
            self._http = None
        if self._grpc_stream is not None:  # its runs ended above: the streams end at once
            await self._grpc_stream.stop(grace)
            self._grpc_stream = None
        if self._server is not None:
            await self._server.stop(grace)
            self._server = None
        if self._channels is not None:
            await self._channels.close()
        if self._frontend is not None:
            self._frontend.tokenize_pool.close()
        if self._primary is not None:
            await self._primary.close()

    async def wait_for_termination(self) -> None:
        if self._server is not None:
            await self._server.wait_for_termination()

    # -- internals -------------------------------------------------------------------------

    async def _sweep(self) -> None:
        """Drops silent workers. Each wakeup is also the loop's liveness tick: how late it
        ran is how long this loop could not process heartbeats, and is credited to every
        worker before any is judged (``Registry.tick``)."""
        assert self.registry is not None
        # A quarter of the timeout: a silent worker is dropped at most 25% late.
        period = min(0.5, self.config.heartbeat_timeout_s / 4)
        self.registry.tick(period)
        while True:
            await asyncio.sleep(period)
            late = self.registry.tick(period)
            if late > STALL_LOG_S:
                log.warning("the router's event loop stalled for %.1f s: no worker is "
                            "charged for heartbeats it could not process then", late)
            for w in self.registry.sweep():
                log.warning("dropped %s %s (%s): %s", w.role_name, w.worker_id, w.address,
                            self.registry.silence_reason(w))

    def _health_changed(self) -> None:
        self._spawn(self._set_health())

    async def _set_health(self) -> None:
        assert self.registry is not None and self._health is not None
        status = (health_pb2.HealthCheckResponse.SERVING if self.registry.serving()
                  else health_pb2.HealthCheckResponse.NOT_SERVING)
        for name in ("", ROUTER_SERVICE):
            await self._health.set(name, status)

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
