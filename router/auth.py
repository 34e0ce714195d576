"""Client authentication and transport security of the router's front doors.

One API key (``--api-key``) guards the client APIs: HTTP ``/v1/*`` via the Authorization
header, gRPC ``pdserve.v1.Router`` via the ``authorization`` metadata, both ``Bearer <key>``.
Health, reflection and the Registry stay open to the key: probes and load balancers carry
no key, and workers prove themselves with the cluster token instead. One certificate
(``--tls-cert/--tls-key``) serves both doors.
"""

from __future__ import annotations

import hmac
import ssl
from collections.abc import Awaitable, Callable
from typing import Any

import grpc

UNAUTHENTICATED_MESSAGE = "authorization: a valid 'Bearer <api key>' is required"


def bearer_ok(header: str | None, api_key: str) -> bool:
    """True when no key is configured or ``header`` is ``Bearer <api_key>``."""
    if not api_key:
        return True
    if not header:
        return False
    scheme, _, token = header.strip().partition(" ")
    # Constant-time: response timing must not leak how much of a guess was right.
    return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(),
                                                              api_key.encode())


def _read(path: str, flag: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as e:
        raise ValueError(f"{flag}: cannot read {path!r}: {e.strerror}") from e


def grpc_server_credentials(cert: str, key: str) -> grpc.ServerCredentials:
    return grpc.ssl_server_credentials([(_read(key, "--tls-key"), _read(cert, "--tls-cert"))])


def http_ssl_context(cert: str, key: str) -> ssl.SSLContext:
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    try:
        ctx.load_cert_chain(cert, key)
    except (OSError, ssl.SSLError) as e:
        raise ValueError(f"--tls-cert/--tls-key: cannot load {cert!r} / {key!r}: {e}") from e
    return ctx


class ApiKeyInterceptor(grpc.aio.ServerInterceptor):
    """Refuses calls to the guarded services without the API key (UNAUTHENTICATED)."""

    def __init__(self, api_key: str, guarded_services: set[str]) -> None:
        self.api_key = api_key
        self.guarded = guarded_services  # full names, e.g. "pdserve.v1.Router"

    async def intercept_service(
        self, continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        service = handler_call_details.method.split("/")[1] if handler_call_details.method \
            else ""
        if handler is None or service not in self.guarded:
            return handler
        metadata = dict(handler_call_details.invocation_metadata or ())  # type: ignore[arg-type]
        if bearer_ok(metadata.get("authorization"), self.api_key):
            return handler
        return _denying(handler)


def _denying(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    """A handler of the same shape as ``handler`` that only refuses the call."""

    async def deny(request: Any, context: grpc.aio.ServicerContext) -> None:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, UNAUTHENTICATED_MESSAGE)

    kw = {"request_deserializer": handler.request_deserializer,
          "response_serializer": handler.response_serializer}
    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(deny, **kw)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(deny, **kw)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(deny, **kw)
    return grpc.unary_unary_rpc_method_handler(deny, **kw)
