"""What peers exchange before any byte moves, and the check that refuses a mismatch."""

from __future__ import annotations

import dataclasses
import hmac
from typing import Any

from engine.kv_layout import KVLayout
from transfer.types import PROTOCOL_VERSION, HandshakeError


def hello(layout: KVLayout, backend: str, plane_info: bytes,
          cluster_token: str = "") -> dict[str, Any]:
    """Both directions use the same payload: version, backend, layout and data-plane info;
    the sender adds the cluster token (a receiver never sends its own back)."""
    out = {"version": PROTOCOL_VERSION, "backend": backend,
           "layout": dataclasses.asdict(layout), "fingerprint": layout.fingerprint(),
           "plane": plane_info}
    if cluster_token:
        out["token"] = cluster_token
    return out


def check_token(expected: str, remote: dict[str, Any], who: str) -> None:
    """A receiver with a cluster token refuses a sender that does not present it."""
    if not expected:
        return
    got = remote.get("token")
    # Constant-time, like the router's check: the token is what keeps strangers out.
    if not isinstance(got, str) or not hmac.compare_digest(got.encode(), expected.encode()):
        raise HandshakeError(f"{who}: wrong or missing cluster token")


def check(local: KVLayout, backend: str, remote: dict[str, Any], who: str) -> None:
    """Raises HandshakeError naming every differing field; ``who`` names the peer."""
    if remote.get("version") != PROTOCOL_VERSION:
        raise HandshakeError(f"{who}: protocol version {remote.get('version')!r} != "
                             f"{PROTOCOL_VERSION}")
    if remote.get("backend") != backend:
        raise HandshakeError(f"{who}: backend {remote.get('backend')!r} != {backend!r}")
    if remote.get("fingerprint") != local.fingerprint():
        try:
            other = KVLayout(**remote["layout"])
            diff = local.describe_mismatch(other)
        except (KeyError, TypeError, ValueError) as e:
            diff = f"unreadable remote layout ({e})"
        raise HandshakeError(f"{who}: KV layout mismatch: {diff} "
                             f"(fingerprint {local.fingerprint()} != {remote.get('fingerprint')})")
