"""What every command that talks to a running router shares: its --api-key (default
$PDSERVE_API_KEY) and --router-ca flags, the channel and call metadata they make, and one
line for a router that refuses or cannot be reached (never a gRPC traceback)."""

from __future__ import annotations

import argparse
import os
from typing import Any

API_KEY_ENV = "PDSERVE_API_KEY"


class RouterError(RuntimeError):
    """A router refused a command's call or could not be reached; the message is one line
    naming the router and what to do. `pdserve` prints it and exits 1."""


def add_router_client_args(p: argparse.ArgumentParser | Any) -> None:
    p.add_argument("--api-key", default=os.environ.get(API_KEY_ENV, ""),
                   help=f"the router's API key, if it has one (default: ${API_KEY_ENV})")
    p.add_argument("--router-ca", default="",
                   help="PEM CA certificate of a TLS router (its --tls-cert); default plaintext")


def auth_metadata(api_key: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {api_key}"),) if api_key else ()


def _credentials(router_ca: str) -> Any:
    import grpc

    try:
        with open(router_ca, "rb") as f:
            return grpc.ssl_channel_credentials(root_certificates=f.read())
    except OSError as e:
        raise ValueError(f"--router-ca: cannot read {router_ca}: {e.strerror}") from None


def channel(address: str, router_ca: str = "", options: Any = None) -> Any:
    """A blocking channel to the router (TLS when ``router_ca`` is given)."""
    import grpc

    if router_ca:
        return grpc.secure_channel(address, _credentials(router_ca), options=options)
    return grpc.insecure_channel(address, options=options)


def aio_channel(address: str, router_ca: str = "", options: Any = None) -> Any:
    """An asyncio channel to the router (TLS when ``router_ca`` is given)."""
    import grpc

    if router_ca:
        return grpc.aio.secure_channel(address, _credentials(router_ca), options=options)
    return grpc.aio.insecure_channel(address, options=options)


def error_line(address: str, e: Any) -> str:
    """One line for a failed call to the router at ``address`` (a ``grpc.RpcError``)."""
    import grpc

    code = e.code() if callable(getattr(e, "code", None)) else None
    details = (e.details() if callable(getattr(e, "details", None)) else "") or ""
    details = " ".join(str(details).split())  # gRPC's details can span lines
    if code == grpc.StatusCode.UNAUTHENTICATED:
        return (f"the router at {address} refused the call: {details or 'unauthenticated'} "
                f"(pass its key with --api-key or ${API_KEY_ENV})")
    if code == grpc.StatusCode.UNAVAILABLE:
        if len(details) > 200:
            details = details[:197] + "..."
        return f"cannot reach the router at {address}: {details or 'unavailable'}"
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return f"the router at {address} did not answer in time"
    name = code.name if code is not None else type(e).__name__
    return f"the router at {address} answered {name}: {details}"
