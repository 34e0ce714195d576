"""The hand-framed gRPC door over TLS (ALPN h2) on an in-process router with no workers:
a grpcio client's call is checked for its key and then refused as the main port refuses
it (no workers: UNAVAILABLE with the same message), and the config names a bad port."""

from __future__ import annotations

import asyncio
from typing import Any

import grpc
import pytest
from pdserve.v1 import common_pb2, router_pb2, router_pb2_grpc
from router_http.certs import make_cert

from engine.model_source import resolve_model
from engine.tokenizer import Tokenizer
from router.config import RouterConfig
from router.server import RouterServer, host_port


def _request() -> router_pb2.GenerateRequest:
    return router_pb2.GenerateRequest(prompt="hi",
                                      sampling=common_pb2.SamplingParams(max_tokens=4))


def test_tls_door_checks_the_key_and_refuses_like_the_main_port(tmp_path: Any) -> None:
    cert, key = make_cert(str(tmp_path))

    async def main() -> None:
        cfg = RouterConfig(grpc_port=0, grpc_stream_port=0, api_key="sesame",
                           tls_cert=cert, tls_key=key)
        server = RouterServer(cfg, tokenizer=Tokenizer.from_source(resolve_model(None)))
        await server.start()
        try:
            assert server.grpc_stream_port > 0
            with open(cert, "rb") as f:
                creds = grpc.ssl_channel_credentials(root_certificates=f.read())
            got = {}
            for name, address in (("main", server.address),
                                  ("stream", host_port("127.0.0.1", server.grpc_stream_port))):
                async with grpc.aio.secure_channel(address, creds) as ch:
                    stub = router_pb2_grpc.RouterStub(ch)
                    for md in ((), (("authorization", "Bearer sesame"),)):
                        with pytest.raises(grpc.aio.AioRpcError) as e:
                            [r async for r in stub.Generate(_request(), metadata=md,
                                                            timeout=10)]
                        got[name, bool(md)] = (e.value.code(), e.value.details())
            assert got["stream", False] == got["main", False]
            assert got["stream", False][0] == grpc.StatusCode.UNAUTHENTICATED
            assert got["stream", True] == got["main", True]
            assert got["stream", True][0] == grpc.StatusCode.UNAVAILABLE
        finally:
            await server.stop(0.1)

    asyncio.run(asyncio.wait_for(main(), 30))


def test_the_port_is_checked() -> None:
    with pytest.raises(ValueError, match="--grpc-stream-port"):
        RouterConfig(grpc_stream_port=70000)
