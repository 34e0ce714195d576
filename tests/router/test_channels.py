"""The router's worker channels against real gRPC servers that die and come back at the
same address (a restart, a role change): the new process's first call succeeds at once.

gRPC keeps a channel whose peer went away in reconnect backoff, failing every call at once
with UNAVAILABLE ("connection refused") until the backoff ends, and by default shares a
channel's connection state with every other channel to the same address. Either one made
the first request placed on a restarted worker fail, and the router drop the worker."""

from __future__ import annotations

import asyncio
from typing import Any

import grpc
from pdserve.v1 import common_pb2, worker_pb2, worker_pb2_grpc
from router_fakes import run

from router.control.registry import Registry
from router.requests.channels import WorkerChannels

C = common_pb2.ROLE_CONSUMER


class AbortOnly(worker_pb2_grpc.WorkerServicer):
    """A worker process that answers Abort: enough to see whether a call reaches it."""

    def __init__(self) -> None:
        self.aborts: list[str] = []

    async def Abort(self, request: worker_pb2.WorkerAbortRequest, context: Any
                    ) -> worker_pb2.WorkerAbortResponse:
        self.aborts.append(request.request_id)
        return worker_pb2.WorkerAbortResponse(ok=True)


async def serve(port: int = 0) -> tuple[grpc.aio.Server, AbortOnly, int]:
    server, servicer = grpc.aio.server(), AbortOnly()
    worker_pb2_grpc.add_WorkerServicer_to_server(servicer, server)
    port = server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    return server, servicer, port


def register(reg: Registry, worker_id: str, port: int) -> Any:
    return reg.register(worker_id=worker_id, role=C, address=f"127.0.0.1:{port}",
                        kv_address="tcp://127.0.0.1:1", max_model_len=64)


async def abort(stub: worker_pb2_grpc.WorkerStub, rid: str) -> None:
    await stub.Abort(worker_pb2.WorkerAbortRequest(request_id=rid), timeout=5)


async def calls_fail_while_it_is_gone(stub: worker_pb2_grpc.WorkerStub) -> None:
    """What the router's calls meet while the worker rebuilds: each fails, and each failed
    connect grows the channel's backoff."""
    for i in range(4):
        try:
            await abort(stub, f"gone-{i}")
        except grpc.aio.AioRpcError as e:
            assert e.code() == grpc.StatusCode.UNAVAILABLE
        else:
            raise AssertionError("a call reached a stopped server")
        await asyncio.sleep(0.25)


def test_a_worker_registered_again_at_the_same_address_is_reached_at_once() -> None:
    async def main() -> None:
        reg = Registry(heartbeat_timeout_s=30)
        channels = WorkerChannels(close_delay_s=5.0)
        server, _, port = await serve()
        first = register(reg, "c0", port)
        await abort(channels.stub(first), "r1")
        await server.stop(None)  # the process dies (or rebuilds in its new role)
        await calls_fail_while_it_is_gone(channels.stub(first))
        server, servicer, _ = await serve(port)  # back, same address
        again = register(reg, "c0", port)
        assert again.incarnation > first.incarnation
        await abort(channels.stub(again), "r2")  # no backoff inherited: reached at once
        assert servicer.aborts == ["r2"]
        # a late abort for the replaced registration's request rides the current channel
        await abort(channels.stub(first), "r1-late")
        assert servicer.aborts == ["r2", "r1-late"]
        await channels.close()
        await server.stop(None)

    run(main())


def test_a_new_channel_does_not_inherit_another_channels_backoff() -> None:
    """Another worker id at the same address (a new worker on a freed port) while the old
    worker's channel is still open in its close delay."""
    async def main() -> None:
        reg = Registry(heartbeat_timeout_s=30)
        channels = WorkerChannels(close_delay_s=5.0)
        server, _, port = await serve()
        old = register(reg, "c0", port)
        await abort(channels.stub(old), "r1")
        await server.stop(None)
        await calls_fail_while_it_is_gone(channels.stub(old))
        server, servicer, _ = await serve(port)
        await abort(channels.stub(register(reg, "c1", port)), "r2")
        assert servicer.aborts == ["r2"]
        await channels.close()
        await server.stop(None)

    run(main())
