"""The router refuses a worker whose producer --lease is too short for its --hold-interval:
while a consumer's reservation waits for blocks, the router's holds (one per hold interval)
are all that keep the producer from freeing the request's KV, so a lease under two intervals
would free it between two holds, or at the first hold that comes late. The worker learns why
at start instead of failing requests under load. Real parts: the router's Registry service
over gRPC, and the worker's Registration client."""

from __future__ import annotations

import asyncio
import dataclasses

import grpc
import pytest
from pdserve.v1 import common_pb2, worker_pb2, worker_pb2_grpc

from deploy.cli import main
from router.control.registry import Registry
from router.control.registry_servicer import RegistryServicer
from worker.messages import ReadyInfo
from worker.registration import Registration

HOLD_S = 1.0
INFO = ReadyInfo("m", "fp", 64)


async def _router(registry: Registry) -> tuple[grpc.aio.Server, str]:
    server = grpc.aio.server()
    worker_pb2_grpc.add_RegistryServicer_to_server(
        RegistryServicer(registry, 0.05, "", hold_interval_s=HOLD_S), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, f"127.0.0.1:{port}"


@pytest.mark.parametrize("lease,ok", [(1.99, False), (0.5, False), (float("nan"), False),
                                      (2.0, True), (30.0, True), (0.0, True)])
def test_register_checks_the_lease_against_the_hold_interval(lease: float, ok: bool) -> None:
    async def run() -> None:
        registry = Registry(heartbeat_timeout_s=30.0)
        server, address = await _router(registry)
        try:
            async with grpc.aio.insecure_channel(address) as ch:
                call = worker_pb2_grpc.RegistryStub(ch).Register(worker_pb2.RegisterRequest(
                    worker_id="producer-0", role=common_pb2.ROLE_PRODUCER,
                    address="127.0.0.1:1", model="m", kv_fingerprint="fp", max_model_len=64,
                    lease_s=lease), timeout=5)
                if ok:  # 0: an older worker that does not say; not checked
                    await call
                    assert registry.get("producer-0") is not None
                    return
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    await call
            assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            msg = e.value.details()
            assert msg.startswith("lease_s: worker producer-0's --lease"), msg
            assert "under 2x this router's --hold-interval (1 s)" in msg, msg
            assert registry.get("producer-0") is None
            # the router keeps serving: a worker with a good lease registers next
            async with grpc.aio.insecure_channel(address) as ch:
                await worker_pb2_grpc.RegistryStub(ch).Register(worker_pb2.RegisterRequest(
                    worker_id="producer-1", role=common_pb2.ROLE_PRODUCER,
                    address="127.0.0.1:2", model="m", kv_fingerprint="fp", max_model_len=64,
                    lease_s=2 * HOLD_S), timeout=5)
            assert registry.get("producer-1") is not None
        finally:
            await server.stop(None)

    asyncio.run(run())


@pytest.mark.parametrize("role", ["producer", "consumer"])
def test_a_worker_with_a_short_lease_stops_naming_both_flags(role: str) -> None:
    """Checked in every role: a role change can make a consumer a producer later."""
    async def run() -> None:
        registry = Registry(heartbeat_timeout_s=30.0)
        server, address = await _router(registry)
        info = dataclasses.replace(INFO, lease_s=1.0, kv_address="tcp://127.0.0.1:1")
        reg = Registration(address, f"{role}-0", role, "127.0.0.1:1", info, lambda: None)
        try:
            with pytest.raises(RuntimeError) as e:
                await asyncio.wait_for(reg.run(), 10)
            msg = str(e.value)
            assert msg.startswith(f"the router refused this worker: lease_s: worker {role}-0's "
                                  "--lease (1 s)"), msg
            assert "raise the worker's --lease or lower the router's --hold-interval" in msg
            assert registry.all() == []
        finally:
            await reg.close()
            await server.stop(None)

    asyncio.run(run())


@pytest.mark.parametrize("flag,value", [("--lease", "0"), ("--lease", "-3"), ("--lease", "nan"),
                                        ("--reservation-timeout", "0"),
                                        ("--drain-timeout", "inf")])
def test_worker_refuses_a_bad_timeout_flag_before_starting(
        capsys: pytest.CaptureFixture[str], flag: str, value: str) -> None:
    assert main(["producer", "--model", "/nonexistent", "--router", "127.0.0.1:1",
                 flag, value]) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"pdserve: error: {flag}: must be a number of seconds > 0, got " \
                  f"{float(value)}", err
