"""`pdserve doctor --router`: fingerprints, versions and KV ports as a real router reports
them (ClusterStatus fields from each worker's Register), pass and fail, the fail cases made
on purpose: workers registered with two fingerprints, two versions, a closed KV port and
a closed Outputs port."""

from __future__ import annotations

import asyncio
import socket
import threading
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager

import grpc
import pytest
from pdserve.v1 import common_pb2, router_pb2, router_pb2_grpc, worker_pb2, worker_pb2_grpc

from deploy.cli import main
from deploy.doctor import FAIL, PASS, cluster_checks, render
from deploy.ports import free_port
from engine.model_source import model_display_name, resolve_model
from router.config import RouterConfig
from router.server import RouterServer

MODEL = model_display_name(resolve_model(None))


@contextmanager
def router() -> Iterator[str]:
    """A real router on its own event loop thread; heartbeats never expire in the test."""
    loop = asyncio.new_event_loop()
    server = RouterServer(RouterConfig(grpc_port=0, heartbeat_timeout_s=600))
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    asyncio.run_coroutine_threadsafe(server.start(), loop).result(60)
    try:
        yield server.address
    finally:
        asyncio.run_coroutine_threadsafe(server.stop(0), loop).result(30)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)


def listener(stack: ExitStack) -> str:
    s = stack.enter_context(socket.socket())
    s.bind(("127.0.0.1", 0))
    s.listen()
    return f"127.0.0.1:{s.getsockname()[1]}"


def register(address: str, worker_id: str, role: int, grpc_addr: str, fingerprint: str,
             version: str, kv_address: str = "", outputs_address: str = "",
             outputs_unix: str = "") -> None:
    with grpc.insecure_channel(address) as ch:
        worker_pb2_grpc.RegistryStub(ch).Register(worker_pb2.RegisterRequest(
            worker_id=worker_id, role=role, address=grpc_addr, kv_address=kv_address,  # type: ignore[arg-type]
            outputs_address=outputs_address, outputs_unix=outputs_unix,
            model=MODEL, kv_fingerprint=fingerprint, max_model_len=2048, version=version,
            load=common_pb2.WorkerLoad(kv_blocks_free=8, kv_blocks_total=8)), timeout=10)


def statuses(checks: list) -> dict[str, str]:  # type: ignore[type-arg]
    return {c.name: c.status for c in checks}


def test_status_reports_registration_and_doctor_passes() -> None:
    with ExitStack() as stack, router() as addr:
        kv = listener(stack)
        register(addr, "p0", common_pb2.ROLE_PRODUCER, listener(stack), "fp-a", "0.1.0")
        register(addr, "c0", common_pb2.ROLE_CONSUMER, listener(stack), "fp-a", "0.1.0",
                 kv_address=f"tcp://{kv}", outputs_unix="@pdserve-outputs-c0")
        with grpc.insecure_channel(addr) as ch:
            ws = {w.worker_id: w for w in router_pb2_grpc.RouterStub(ch).ClusterStatus(
                router_pb2.ClusterStatusRequest(), timeout=10).workers}
        assert (ws["c0"].kv_fingerprint, ws["c0"].version, ws["c0"].kv_address) == \
            ("fp-a", "0.1.0", f"tcp://{kv}")
        assert (ws["p0"].kv_address, ws["p0"].draining) == ("", False)
        assert (ws["c0"].outputs_unix, ws["p0"].outputs_unix) == ("@pdserve-outputs-c0", "")
        checks = cluster_checks(addr)
        assert all(c.status == PASS for c in checks), render(checks)
        by = {c.name: c for c in checks}
        assert by["kv fingerprints"].detail == "fp-a on 2 worker(s)"
        assert by["versions"].detail == "0.1.0 on 2 worker(s)"
        assert by["consumer c0 KV port"].detail == f"{kv} reachable"
        assert main(["doctor", "--skip-node", "--router", addr]) == 0


def test_mismatched_fingerprints_versions_and_a_closed_kv_port_fail(
        capsys: pytest.CaptureFixture[str]) -> None:
    closed = free_port()
    with ExitStack() as stack, router() as addr:
        # colocated workers: the router refuses a producer/consumer of another layout at
        # Register, so the mismatch doctor must catch is one the registry lets through
        register(addr, "x0", common_pb2.ROLE_COLOCATED, listener(stack), "fp-a", "0.1.0")
        register(addr, "x1", common_pb2.ROLE_COLOCATED, listener(stack), "fp-b", "0.2.0")
        checks = cluster_checks(addr)
        st = statuses(checks)
        assert st["kv fingerprints"] == FAIL and st["versions"] == FAIL, render(checks)
        by = {c.name: c for c in checks}
        assert by["kv fingerprints"].detail == "2 KV layouts: fp-a: x0, fp-b: x1"
        assert by["versions"].detail == "2 versions: 0.1.0: x0, 0.2.0: x1"
        assert st["roles"] == PASS and st["colocated x0 gRPC port"] == PASS
        assert main(["doctor", "--skip-node", "--router", addr]) == 1
        assert "kv fingerprints" in capsys.readouterr().out
    with ExitStack() as stack, router() as addr:
        register(addr, "p0", common_pb2.ROLE_PRODUCER, listener(stack), "fp-a", "0.1.0")
        register(addr, "c0", common_pb2.ROLE_CONSUMER, listener(stack), "fp-a", "0.1.0",
                 kv_address=f"tcp://127.0.0.1:{closed}",
                 outputs_address=f"127.0.0.1:{closed}")
        checks = cluster_checks(addr)
        failed = [c.name for c in checks if c.status == FAIL]
        assert failed == ["consumer c0 Outputs port", "consumer c0 KV port"], render(checks)


def test_a_router_reading_the_rpc_for_an_advertised_port_warns() -> None:
    """The router fell back to the Outputs RPC (the port was unreachable from it): doctor
    says so even where the port is reachable from where doctor runs."""
    from deploy.doctor import WARN, check_outputs

    with ExitStack() as stack:
        port = listener(stack)
        assert [c.status for c in check_outputs("consumer c0", port, "tcp")] == [PASS]
        checks = check_outputs("consumer c0", port, "grpc")
        assert [(c.name, c.status) for c in checks] == [("consumer c0 Outputs port", PASS),
                                                        ("consumer c0 Outputs stream", WARN)]
        assert port in checks[1].detail and "open the port" in checks[1].detail
    assert check_outputs("consumer c0", "", "grpc") == []  # none advertised (--outputs-port -1)


def test_a_router_reading_the_unix_socket_is_said_and_the_port_still_checked() -> None:
    from deploy.doctor import check_outputs

    with ExitStack() as stack:
        port = listener(stack)
        checks = check_outputs("consumer c0", port, "unix", outputs_unix="@pdserve-outputs-x")
        assert [(c.name, c.status) for c in checks] == [("consumer c0 Outputs port", PASS),
                                                        ("consumer c0 Outputs stream", PASS)]
        assert "@pdserve-outputs-x" in checks[1].detail
    closed = free_port()  # a router elsewhere reads the port: a closed one still fails
    checks = check_outputs("consumer c0", f"127.0.0.1:{closed}", "unix",
                           outputs_unix="@pdserve-outputs-x")
    assert checks[0].status == FAIL
