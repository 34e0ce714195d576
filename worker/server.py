"""One worker node: its engine process, its gRPC server, and its registration."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import multiprocessing as mp
import sys
import uuid
from dataclasses import dataclass

import grpc
from pdserve.v1 import worker_pb2_grpc

from worker import ipc
from worker.engine_loop import EngineSpec, engine_process_main
from worker.kv_publisher import KVPublisher
from worker.messages import StopCmd
from worker.metrics_server import MetricsServer, ServingCounters, WorkerMetrics
from worker.outputs_port import OutputsPort
from worker.registration import Registration
from worker.servicer import EngineBridge, WorkerServicer

log = logging.getLogger("pdserve.worker")


@dataclass(frozen=True)
class WorkerConfig:
    spec: EngineSpec
    # the role's gRPC servicer (a WorkerServicer serving its RPC), chosen with the spec by
    # the command that names the role
    servicer: type[WorkerServicer]
    router: str  # the router's gRPC address (host:port)
    bind_host: str = "127.0.0.1"  # where this worker's gRPC server listens
    advertise_host: str = ""  # what peers dial ("" = bind_host)
    port: int = 0  # 0 = any free port
    worker_id: str = ""  # "" = role + random suffix
    cluster_token: str = ""
    ready_timeout_s: float = 300.0  # model loading
    metrics_port: int = 0  # Prometheus /metrics on bind_host; 0: any free port, -1: off
    # the Outputs stream over plain TCP (worker/outputs_port.py) on bind_host; 0: any free
    # port, -1: off (the router then reads the Outputs RPC; the Unix socket is off too)
    outputs_port: int = 0
    # the same stream on an abstract Unix socket as well (Linux only; ignored elsewhere), read
    # by a router on this host at less CPU per write than loopback TCP; False: TCP only
    outputs_unix: bool = True
    router_ca: str = ""  # PEM CA to verify a TLS router with; "": plaintext to the router
    # gRPC server interceptors (worker/drain.py DrainGate refuses new requests in a drain)
    interceptors: tuple[grpc.aio.ServerInterceptor, ...] = ()

    def __post_init__(self) -> None:
        if not 0 <= self.port < 65536:
            raise ValueError(f"port: out of range: {self.port}")
        if not self.router:
            raise ValueError("router: the router's address is required")
        if not -1 <= self.metrics_port < 65536:
            raise ValueError(f"metrics_port: must be -1 (off) or in [0, 65535], got "
                             f"{self.metrics_port}")
        if not -1 <= self.outputs_port < 65536:
            raise ValueError(f"outputs_port: must be -1 (off) or in [0, 65535], got "
                             f"{self.outputs_port}")


class WorkerServer:
    def __init__(self, config: WorkerConfig) -> None:
        self.config = config
        # no role in a default id: it outlives a role change
        self.worker_id = config.worker_id or f"worker-{uuid.uuid4().hex[:6]}"
        self.paths = ipc.IpcPaths.fresh()
        self.proc: mp.process.BaseProcess | None = None
        self.server: grpc.aio.Server | None = None
        self.bridge: EngineBridge | None = None
        self.tasks: list[asyncio.Task[None]] = []
        self.address = ""
        self.metrics: WorkerMetrics | None = None
        self.metrics_server: MetricsServer | None = None
        self.registration: Registration | None = None
        self.kv_publisher: KVPublisher | None = None
        self.outputs_port: OutputsPort | None = None

    async def start(self) -> str:
        cfg = self.config
        self.bridge = EngineBridge(self.paths)
        # from the engine's first event on: the router's index must see every block
        pub = self.kv_publisher = KVPublisher(cfg.router, self.worker_id, cfg.cluster_token,
                                              cfg.router_ca)
        self.bridge.on_kv = pub.add
        self.tasks.append(asyncio.create_task(self.bridge.pump()))
        self.proc = mp.get_context("spawn").Process(
            target=engine_process_main, args=(cfg.spec, self.paths), daemon=True,
            name=f"{self.worker_id}-engine")
        self.proc.start()
        info = await asyncio.wait_for(self.bridge.ready, cfg.ready_timeout_s)
        bridge = self.bridge
        hub = bridge.hub
        self.metrics = WorkerMetrics(
            self.worker_id, cfg.spec.role, lambda: bridge.load, lambda: ServingCounters(
                output_batches=hub.batches, output_messages=hub.tokens,
                kv_event_batches=pub.batches, kv_event_snapshots=pub.snapshots,
                kv_events_dropped_pending=pub.dropped))
        self.server = grpc.aio.server(interceptors=cfg.interceptors)
        servicer = cfg.servicer(self.bridge, self.worker_id, self.metrics, cfg.cluster_token)
        worker_pb2_grpc.add_WorkerServicer_to_server(servicer, self.server)
        port = self.server.add_insecure_port(f"{cfg.bind_host}:{cfg.port}")
        await self.server.start()
        host = cfg.advertise_host or cfg.bind_host
        self.address = f"{host}:{port}"
        outputs_address = outputs_unix = ""
        if cfg.outputs_port >= 0:
            self.outputs_port = OutputsPort(hub, cfg.cluster_token, servicer.orphaned,
                                            failed=lambda: bridge.fatal)
            oport = await self.outputs_port.start(cfg.bind_host, cfg.outputs_port)
            outputs_address = f"{host}:{oport}"
            if cfg.outputs_unix and sys.platform == "linux":
                try:
                    outputs_unix = await self.outputs_port.start_unix()
                except OSError as e:  # a sandbox without AF_UNIX: TCP serves every router
                    log.warning("%s: no Unix socket for the Outputs stream (%s); TCP only",
                                self.worker_id, e)
        if cfg.metrics_port >= 0:
            self.metrics_server = MetricsServer(self.metrics)
            mport = await self.metrics_server.start(cfg.bind_host, cfg.metrics_port)
            log.info("%s metrics on http://%s:%d/metrics", self.worker_id,
                     cfg.advertise_host or cfg.bind_host, mport)
        reg = Registration(cfg.router, self.worker_id, cfg.spec.role, self.address,
                           dataclasses.replace(info, lease_s=cfg.spec.lease_s),
                           lambda: bridge.load, cfg.cluster_token, cfg.router_ca,
                           failed=lambda: bridge.fatal, outputs_address=outputs_address,
                           outputs_unix=outputs_unix)
        self.registration = reg
        bridge.on_wake = reg.watch.poke
        self.tasks.append(asyncio.create_task(reg.run()))
        self.tasks.append(asyncio.create_task(pub.run()))
        self.tasks.append(asyncio.create_task(self._watch_engine()))
        log.info("%s serving on %s (engine ready: %s)", self.worker_id, self.address,
                 dataclasses.asdict(info))
        return self.address

    async def _watch_engine(self) -> None:
        # The process's sentinel becomes readable when it exits: the loop learns of it
        # without a poll (a 0.2 s poll was five idle wake-ups a second)
        if self.proc is not None and self.proc.is_alive():
            loop = asyncio.get_running_loop()
            exited: asyncio.Future[None] = loop.create_future()
            fd = self.proc.sentinel

            def on_exit() -> None:
                if not exited.done():
                    exited.set_result(None)

            loop.add_reader(fd, on_exit)
            try:
                await exited
            finally:
                loop.remove_reader(fd)
            self.proc.join(1.0)  # reaped, so exitcode is set
        code = self.proc.exitcode if self.proc is not None else None
        if self.bridge is not None:
            self.bridge.fail_all("engine process exited")
        # An error, so the worker exits non-zero and a supervisor restarts it.
        raise RuntimeError(f"{self.worker_id}: engine process exited (exit code {code})")

    async def wait(self) -> None:
        """Runs until a task fails (router refused us, engine died) or stop()."""
        done, _ = await asyncio.wait(self.tasks, return_when=asyncio.FIRST_COMPLETED)
        for t in done:
            if not t.cancelled() and t.exception() is not None:
                raise t.exception()  # type: ignore[misc]

    async def stop(self) -> None:
        for t in self.tasks:
            t.cancel()
        if self.registration is not None:  # its heartbeat process and channel
            await self.registration.close()
        if self.kv_publisher is not None:
            await self.kv_publisher.close()
        if self.outputs_port is not None:
            await self.outputs_port.stop()
        if self.server is not None:
            await self.server.stop(grace=1.0)
        if self.metrics_server is not None:
            await self.metrics_server.stop()
        if self.bridge is not None:
            self.bridge.send(StopCmd())
        if self.proc is not None:
            await asyncio.get_running_loop().run_in_executor(None, self.proc.join, 10)
            if self.proc.is_alive():
                self.proc.kill()
        if self.bridge is not None:
            self.bridge.close()
        self.paths.cleanup()

