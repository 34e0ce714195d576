"""`pdserve bench --connections N`: the requests are dealt over N real gRPC connections.

A router's frontends share its port by SO_REUSEPORT, which spreads connections, not streams.
gRPC puts every channel of a process to one address on one connection unless the channel
opts out of the shared subchannel pool, so N backends without it reach one frontend. The
server here is a real grpc.aio server with a stand-in Router servicer that records each
call's peer (the client's address and port: one per connection).
"""

from __future__ import annotations

import asyncio
from collections import Counter

import grpc
import pytest
from pdserve.v1 import common_pb2, router_pb2, router_pb2_grpc

from deploy.benchmark.backend import SamplingChoice
from deploy.benchmark.grpc_backend import GrpcBackend
from deploy.benchmark.record import RequestRecord
from deploy.benchmark.spread_backend import SpreadBackend
from deploy.benchmark.workload import RequestSpec
from deploy.cli import main


class PeerRecorder(router_pb2_grpc.RouterServicer):
    def __init__(self) -> None:
        self.peers: list[str] = []

    async def Generate(self, request, context):  # type: ignore[no-untyped-def]
        self.peers.append(context.peer())
        yield router_pb2.GenerateResponse(token_ids=[7],
                                          finish_reason=common_pb2.FINISH_REASON_LENGTH)


async def _serve_and_send(backends: list[GrpcBackend], requests: int
                          ) -> tuple[list[str], list[RequestRecord]]:
    server = grpc.aio.server()
    rec = PeerRecorder()
    router_pb2_grpc.add_RouterServicer_to_server(rec, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        address = f"127.0.0.1:{port}"
        for b in backends:
            b.address = address
        spread = SpreadBackend(list(backends))
        await spread.open()
        records = [RequestRecord(i, 1, 1) for i in range(requests)]
        try:
            await asyncio.gather(*(spread.send(RequestSpec((1,), 1), r, SamplingChoice())
                                   for r in records))
        finally:
            await spread.close()
    finally:
        await server.stop(None)
    return rec.peers, records


def test_requests_are_dealt_over_distinct_connections() -> None:
    peers, records = asyncio.run(_serve_and_send([GrpcBackend("") for _ in range(4)], 12))
    assert all(r.success and r.output_tokens == 1 for r in records)
    # four connections (four client ports), three requests each: on one shared connection
    # (channels in the process's subchannel pool) there would be one peer with all twelve
    assert sorted(Counter(peers).values()) == [3, 3, 3, 3], peers


def test_a_spread_needs_a_backend() -> None:
    with pytest.raises(ValueError, match="at least one backend"):
        SpreadBackend([])


@pytest.mark.parametrize("argv, field", [
    (["--connections", "0"], "--connections: must be at least 1"),
    (["--connections", "2", "--backend", "openai", "--base-url", "http://127.0.0.1:9"],
     "--connections: only with --backend grpc"),
])
def test_bad_connections_flag_is_refused_by_name(argv, field, capsys):  # type: ignore[no-untyped-def]
    rc = main(["bench", "--router", "127.0.0.1:9", "--num-prompts", "1", "--concurrency", "1",
               *argv])
    assert rc == 2
    assert field in capsys.readouterr().err
