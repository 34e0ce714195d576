"""A worker whose engine failed leaves the router and never registers again.

Between the failure and the worker's exit (a TP engine stops its ranks and transfer
endpoints first) the worker's gRPC process is still up. Seen in the TP rank-kill e2e test:
the router dropped the consumer for its failed requests, the next heartbeat was answered
"unknown", and the worker registered again; the router then placed requests on a worker that
could only fail them, and, as a new registration, the requests that had failed there did
not exclude it. Real parts: the router's Registry and Membership services over gRPC.
"""

from __future__ import annotations

import asyncio

import grpc
import pytest
from pdserve.v1 import router_pb2_grpc, worker_pb2_grpc

from router.control.registry import Registry
from router.control.registry_servicer import MembershipServicer, RegistryServicer
from worker.messages import ReadyInfo
from worker.registration import Registration

INTERVAL_S = 0.05  # the heartbeat interval the router hands out: ticks in ms, not seconds
INFO = ReadyInfo("m", "fp", 64, kv_address="tcp://127.0.0.1:1")


async def _router(registry: Registry) -> tuple[grpc.aio.Server, str]:
    server = grpc.aio.server()
    worker_pb2_grpc.add_RegistryServicer_to_server(
        RegistryServicer(registry, INTERVAL_S, ""), server)
    router_pb2_grpc.add_MembershipServicer_to_server(MembershipServicer(registry, ""), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, f"127.0.0.1:{port}"


async def _until(cond, timeout_s: float = 5.0) -> None:  # type: ignore[no-untyped-def]
    end = asyncio.get_running_loop().time() + timeout_s
    while not cond():
        assert asyncio.get_running_loop().time() < end, "timed out"
        await asyncio.sleep(0.01)


@pytest.mark.parametrize("router_dropped_it", [True, False])
def test_a_worker_whose_engine_failed_leaves_and_stays_away(router_dropped_it: bool) -> None:
    async def main() -> None:
        registry = Registry(heartbeat_timeout_s=30.0)  # far longer than the test: no expiry
        server, address = await _router(registry)
        fatal: list[str] = []
        reg = Registration(address, "worker-1", "consumer", "127.0.0.1:1", INFO, lambda: None,
                           failed=lambda: fatal[0] if fatal else None)
        task = asyncio.create_task(reg.run())
        try:
            await _until(lambda: registry.get("worker-1") is not None)
            first = registry.get("worker-1")
            await asyncio.sleep(5 * INTERVAL_S)  # heartbeats keep it, as the same registration
            assert registry.get("worker-1") is first
            fatal.append("engine process failed: TPRankError: rank 1 exited")
            if router_dropped_it:  # as the router does when a request fails there
                registry.remove("worker-1", "its request failed")
            # gone at once when the router still had it (not after the 30 s expiry) ...
            await _until(lambda: registry.get("worker-1") is None, timeout_s=2.0)
            # ... and it stays away: 20 intervals, each of which used to register it again
            await asyncio.sleep(20 * INTERVAL_S)
            assert registry.get("worker-1") is None
            assert registry.all() == []
            assert not task.done()  # it idles until the worker exits; it does not fail it
        finally:
            task.cancel()
            await reg.close()
            await server.stop(None)

    asyncio.run(main())
