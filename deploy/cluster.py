"""A local xPyD cluster as child processes: one router and the workers, each its own
`pdserve` command, exactly as multi-node launchers would start them on separate hosts."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc
from pdserve.v1 import common_pb2, router_pb2, router_pb2_grpc

from deploy.cpu_threads import engine_threads
from deploy.launch_checks import assign_devices, worker_names
from deploy.ports import free_port
from deploy.proc_output import ProcOutput, error_line
from deploy.procs import processes


class ClusterStartError(RuntimeError):
    """A process of the cluster died (or the cluster stalled) during start-up; the message
    names the process and its error in one line."""


@dataclass(frozen=True)
class ClusterSpec:
    producers: int = 1
    consumers: int = 1
    colocated: int = 0
    model: str | None = None
    host: str = "127.0.0.1"
    grpc_port: int = 0  # 0: a free port
    http_port: int = -1  # -1: no HTTP front door; 0: a free port
    policy: str = "round_robin"
    transfer_backend: str = "ucx"
    worker_args: tuple[str, ...] = ()  # extra flags for every worker (engine flags)
    producer_args: tuple[str, ...] = ()
    router_args: tuple[str, ...] = ()
    threads: int = 0  # torch threads per worker; 0: the cores split among the workers
    env: dict[str, str] = field(default_factory=dict)
    # Secrets travel to the children in the environment, not argv (which `ps` shows).
    api_key: str = field(default="", repr=False)  # the router's --api-key
    cluster_token: str = field(default="", repr=False)  # router's and workers' --cluster-token
    worker_metrics: bool = True  # give each worker a /metrics port (LocalCluster.metrics_ports)
    devices: tuple[str, ...] = ()  # cycled over producers, consumers, colocated; (): no --device
    # Workers on other hosts of this machine: name ("worker-0") -> (network namespace, its
    # address there); such a worker runs under `ip netns exec`, binds and advertises that
    # address, and reaches the router at ``host`` (which must be reachable from there).
    netns: dict[str, tuple[str, str]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for name in ("producers", "consumers", "colocated"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name}: must be >= 0")
        if self.producers != self.consumers and 0 in (self.producers, self.consumers):
            raise ValueError("producers/consumers: a disaggregated cluster needs at least one "
                             "of each (or neither, with --colocated)")
        if self.producers + self.consumers + self.colocated == 0:
            raise ValueError("colocated: the cluster has no workers")


class LocalCluster:
    def __init__(self, spec: ClusterSpec, log_dir: str | None = None,
                 quiet_start: bool = False) -> None:
        self.spec = spec
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.cmds: dict[str, list[str]] = {}  # how each process was started (for restarts)
        self.outputs: dict[str, ProcOutput] = {}  # without a log dir: piped output
        self.log_paths: dict[str, str] = {}  # with one: each process's log file
        # Children's output reaches the terminal (without a log dir) once this is set:
        # with quiet_start, only after start-up succeeded.
        self.echo = threading.Event()
        if not quiet_start:
            self.echo.set()
        self.grpc_port = spec.grpc_port or free_port(spec.host)
        self.http_port = spec.http_port if spec.http_port != 0 else free_port(spec.host)
        self.router_address = f"{spec.host}:{self.grpc_port}"
        self.log_dir = log_dir
        self.metrics_ports: dict[str, int] = {}  # worker name -> its /metrics port
        # worker name -> the role it started in (the router's ClusterStatus has the current
        # one: a role change keeps the name)
        self.started_as: dict[str, str] = {}

    def _cmd(self, *args: str) -> list[str]:
        return [sys.executable, "-m", "deploy.cli", *args]

    def _spawn(self, name: str, cmd: list[str]) -> None:
        env = {**os.environ, **self.spec.env}
        # UCX warns about every UCX_* variable a transport it did not load would have read.
        env.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")
        env.pop("PDSERVE_API_KEY", None)
        env.pop("PDSERVE_CLUSTER_TOKEN", None)
        if self.spec.cluster_token:
            env["PDSERVE_CLUSTER_TOKEN"] = self.spec.cluster_token
        if self.spec.api_key and name == "router":
            env["PDSERVE_API_KEY"] = self.spec.api_key
        self.cmds[name] = cmd
        if self.log_dir:
            # straight to the file: no reader in this process paces the child's output
            os.makedirs(self.log_dir, exist_ok=True)
            path = os.path.join(self.log_dir, f"{name}.log")
            with open(path, "ab") as log:
                self.procs[name] = subprocess.Popen(cmd, env=env, stdout=log,
                                                    stderr=subprocess.STDOUT,
                                                    start_new_session=True)
            self.log_paths[name] = path
            return
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, start_new_session=True)
        assert proc.stdout is not None
        self.procs[name] = proc
        self.outputs[name] = ProcOutput(name, proc.stdout, None, self.echo)

    def respawn(self, name: str) -> None:
        """Starts a process that exited again, with the command it was first started with;
        what is left of its process group (an engine process) is killed first."""
        old = self.procs[name]
        if old.poll() is None:
            raise RuntimeError(f"{name} is still running")
        try:
            os.killpg(old.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self._spawn(name, self.cmds[name])

    def exit_reason(self, name: str) -> str:
        """One line: how ``name`` exited and the error it wrote last."""
        code = self.procs[name].returncode
        if code is not None and code < 0:  # its last output line says nothing about a kill
            return f"{name} exited (killed by signal {-code})"
        return f"{name} exited (exit {code}): {error_line(self._tail(name))}"

    def _tail(self, name: str) -> list[str]:
        if name in self.outputs:
            self.outputs[name].join(2.0)  # what it wrote before it exited
            return self.outputs[name].tail()
        try:
            with open(self.log_paths[name], "rb") as f:
                f.seek(max(0, os.fstat(f.fileno()).st_size - 8192))
                return f.read().decode(errors="replace").splitlines()[-60:]
        except (OSError, KeyError):
            return []

    def start(self, timeout: float = 240.0) -> None:
        s = self.spec
        model = ["--model", s.model] if s.model else []
        router = ["router", "--host", s.host, "--grpc-port", str(self.grpc_port),
                  "--policy", s.policy, *model, *s.router_args]
        if self.http_port > 0:
            router += ["--http-port", str(self.http_port)]
        self._spawn("router", self._cmd(*router))
        n = s.producers + s.consumers + s.colocated
        common = [*model, "--router", self.router_address, "--threads", str(self.worker_threads()),
                  *s.worker_args]
        devices = assign_devices(s.devices, s.producers, s.consumers, s.colocated)
        for name, role in worker_names(s.producers, s.consumers, s.colocated):
            self.started_as[name] = role
            extra = ["--transfer-backend", s.transfer_backend] if role != "colocated" else []
            if name in devices:
                extra += ["--device", devices[name]]
            if role == "producer":
                extra += list(s.producer_args)
            ns, host = s.netns.get(name, ("", s.host))
            if s.worker_metrics:
                # in a fresh namespace any port is free; the number just has to be known
                self.metrics_ports[name] = port = free_port(s.host if not ns else "127.0.0.1")
                extra += ["--metrics-port", str(port)]
            cmd = self._cmd(role, *common, "--host", host, *extra, "--worker-id", name)
            self._spawn(name, ["ip", "netns", "exec", ns, *cmd] if ns else cmd)
        self.wait_ready(n, timeout)
        self.echo.set()

    def names(self, role: str) -> list[str]:
        """The workers started in ``role``, in order (worker-0 is the first producer of a
        cluster that has one)."""
        return [n for n, r in self.started_as.items() if r == role]

    def worker_threads(self) -> int:
        """Torch threads of each worker: --threads, else this host's usable cores split
        among the workers (each taking all of them would oversubscribe the cores n times)."""
        s = self.spec
        return engine_threads(s.threads, share=s.producers + s.consumers + s.colocated)

    def status(self, timeout: float = 2.0) -> router_pb2.ClusterStatusResponse:
        with grpc.insecure_channel(self.router_address) as ch:
            stub = router_pb2_grpc.RouterStub(ch)
            resp: router_pb2.ClusterStatusResponse = stub.ClusterStatus(
                router_pb2.ClusterStatusRequest(), timeout=timeout,
                metadata=self.auth_metadata())
            return resp

    def auth_metadata(self) -> tuple[tuple[str, str], ...]:
        """gRPC metadata for the router's client API (empty without --api-key)."""
        return (("authorization", f"Bearer {self.spec.api_key}"),) if self.spec.api_key else ()

    def wait_ready(self, n: int, timeout: float) -> None:
        end = time.monotonic() + timeout
        busy = self._router_busy_test()
        while True:
            dead = [name for name, p in self.procs.items() if p.poll() is not None]
            if dead:
                reason = self.exit_reason(dead[0])
                self.stop()
                raise ClusterStartError(f"during start-up, {reason}")
            try:
                workers = self.status().workers
                # Ready means the router would place a request: a worker whose event loop
                # is still behind from start-up (the engines' warm-up starves the gRPC
                # processes on a small machine) is healthy yet refused as busy, so a
                # first request sent at that moment fails with RESOURCE_EXHAUSTED.
                if sum(w.healthy and not busy(w.load) for w in workers) >= n:
                    return
            except grpc.RpcError:
                pass
            if time.monotonic() > end:
                self.stop()
                raise ClusterStartError(f"cluster not ready after {timeout:.0f} s")
            time.sleep(0.3)

    def _router_busy_test(self) -> Callable[[common_pb2.WorkerLoad], bool]:
        """The router's busy test (router/control/registry.busy_reason) at its thresholds
        as this cluster's router_args set them, read by the router's own parser (its
        defaults, its flags' spellings)."""
        import argparse

        from deploy.router_cmd import add_router_parser
        from router.control.registry import busy_reason

        parser = argparse.ArgumentParser()
        add_router_parser(parser.add_subparsers())
        args, _ = parser.parse_known_args(["router", *self.spec.router_args])
        return lambda load: bool(busy_reason(load, args.busy_lag, args.busy_engine_age))

    def kill(self, name: str, sig: int = signal.SIGKILL, group: bool = True) -> None:
        """Kills one process group (a worker's gRPC process and its engine process), or
        with ``group=False`` its leader alone (the engine must then follow by itself)."""
        if group:
            os.killpg(self.procs[name].pid, sig)
        else:
            self.procs[name].send_signal(sig)
        self.procs[name].wait(10)

    def group_alive(self, name: str) -> list[int]:
        """Pids still running (not zombies) in the process group of ``name``."""
        pgid = self.procs[name].pid
        return [p.pid for p in processes() if p.pgrp == pgid and p.state != "Z"]

    def stop(self, drain_s: float = 30.0) -> None:
        """Workers first, then the router: SIGTERM makes each worker drain and deregister
        from the router, which must still be there to hear it (stopping it first made every
        worker report "could not deregister"). A worker still running after ``drain_s``
        (its requests outlived it) is killed, and so is a router that does not stop."""
        workers = {n: p for n, p in self.procs.items() if n != "router"}
        self._terminate(workers, drain_s)
        self._terminate({n: p for n, p in self.procs.items() if n == "router"}, 15.0)

    def _terminate(self, procs: dict[str, subprocess.Popen[bytes]], wait_s: float) -> None:
        for p in procs.values():
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
        end = time.monotonic() + wait_s
        for p in procs.values():
            try:
                p.wait(max(0.1, end - time.monotonic()))
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait(5)

    def __enter__(self) -> LocalCluster:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


ROLE_NAMES = {common_pb2.ROLE_PRODUCER: "producer", common_pb2.ROLE_CONSUMER: "consumer",
              common_pb2.ROLE_COLOCATED: "colocated"}
