"""What peers exchange before any byte moves, and the check that refuses a mismatch."""

from __future__ import annotations

import dataclasses
from typing import Any

from engine.kv_layout import KVLayout
from transfer.types import PROTOCOL_VERSION, HandshakeError


def hello(layout: KVLayout, backend: str, plane_info: bytes) -> dict[str, Any]:
    """Both directions use the same payload: version, backend, layout and data-plane info."""
    return {"version": PROTOCOL_VERSION, "backend": backend,
            "layout": dataclasses.asdict(layout), "fingerprint": layout.fingerprint(),
            "plane": plane_info}


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
