"""The hand-framed gRPC door's listener and its ``Generate`` handler.

The handler is the grpc.aio door's (router/requests/router_servicer.py) on a ``StreamCall``
instead of a grpc.aio context: the same ``Frontend.generate`` with a ``DirectWrite``, so a
decoding request's tokens are written from the pass over the worker's batch
(``StreamCall.write_now``), and the same refusals with the same codes, messages and retry
hints.

Shutdown (``goaway`` then ``stop``): GOAWAY on every connection first (clients open no new
streams here; a stream opened meanwhile is refused with REFUSED_STREAM, which grpc clients
retry elsewhere), then the router ends its runs (each open stream gets its final message
and trailers), then ``stop`` waits up to its grace for the streams to end and closes what
is left.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import ssl

import grpc
from pdserve.v1 import router_pb2

from router.auth import http_ssl_context
from router.config import RouterConfig
from router.grpc_stream.call import StreamCall
from router.grpc_stream.connection import GrpcConnection
from router.requests.direct_write import DirectWrite, WriteFailed
from router.requests.errors import Overloaded, RequestError
from router.requests.frontend import Frontend

log = logging.getLogger(__name__)


class GrpcStreamDoor:
    def __init__(self, frontend: Frontend, config: RouterConfig, max_receive: int) -> None:
        self.frontend = frontend
        self.config = config
        self.api_key = config.api_key
        self.max_receive = max_receive  # bytes of one request message
        self.connections: set[GrpcConnection] = set()
        self.port = 0
        self._server: asyncio.AbstractServer | None = None

    async def start(self) -> int:
        cfg = self.config
        ctx: ssl.SSLContext | None = None
        if cfg.tls_cert:
            ctx = http_ssl_context(cfg.tls_cert, cfg.tls_key)
            ctx.set_alpn_protocols(["h2"])  # grpc clients require h2 by ALPN
        shared = cfg.frontends > 1 or bool(cfg.primary)  # router/control/frontends.py
        try:
            self._server = await asyncio.get_running_loop().create_server(
                lambda: GrpcConnection(self), cfg.listen_host, cfg.grpc_stream_port, ssl=ctx,
                backlog=1024, reuse_port=shared or None)
        except OSError as e:
            raise ValueError(f"--grpc-stream-port: cannot bind {cfg.listen_host}:"
                             f"{cfg.grpc_stream_port}: {e.strerror}") from e
        self.port = int(self._server.sockets[0].getsockname()[1])
        return self.port

    def goaway(self) -> None:
        """No new connections or streams; the open streams go on."""
        if self._server is not None:
            self._server.close()
        for c in list(self.connections):
            c.goaway()

    async def stop(self, grace: float) -> None:
        self.goaway()
        loop = asyncio.get_running_loop()
        until = loop.time() + grace
        while any(c.calls for c in self.connections) and loop.time() < until:
            await asyncio.sleep(0.01)
        for c in list(self.connections):
            for call in list(c.calls.values()):
                call.finish(grpc.StatusCode.UNAVAILABLE, "the router is shutting down")
            c.close()
        if self._server is not None:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._server.wait_closed(), 2.0)
            self._server = None

    async def serve(self, call: StreamCall, request: router_pb2.GenerateRequest) -> None:
        """One Generate call, as ``RouterServicer.Generate`` serves it."""
        writer = DirectWrite(call)
        try:
            async with contextlib.aclosing(self.frontend.generate(
                    request, call.received_ns, "grpc", direct=writer)) as responses:
                async for resp in responses:
                    await writer.send(resp)
            await writer.wait_idle()
            call.finish(grpc.StatusCode.OK)
        except WriteFailed:
            return  # the stream ended under a write: nobody left to tell
        except Overloaded as e:
            call.finish(e.code, e.message, (
                ("retry-after", f"{e.retry_after_s:g}"),
                ("grpc-retry-pushback-ms", str(int(e.retry_after_s * 1000)))))
        except RequestError as e:
            call.finish(e.code, e.message)
        except asyncio.CancelledError:
            return  # the client left, its deadline passed or the connection closed
        except Exception as e:
            log.exception("Generate failed on the gRPC stream door")
            call.finish(grpc.StatusCode.UNKNOWN, f"Unexpected {type(e).__name__}: {e}")
