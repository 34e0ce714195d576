"""What peers exchange before any byte moves, and the check that refuses a mismatch.

Peers must hold the same KV (model, dtype, block size, layers, TOTAL KV heads, head dim,
and a float8 pool's per-layer scales: the fingerprint); their TP split may differ. Each
side's layout carries its TP size and rank, plus the head range it derived from them,
which the other side re-derives: a peer that splits the heads another way is refused,
naming the field.
"""

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
    desc = {**dataclasses.asdict(layout), "head_start": layout.head_start,
            "head_count": layout.head_count}
    out = {"version": PROTOCOL_VERSION, "backend": backend, "layout": desc,
           "fingerprint": layout.fingerprint(), "plane": plane_info}
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


def remote_layout(remote: dict[str, Any], who: str) -> KVLayout:
    """The peer's layout, its claimed head range checked against its TP size and rank."""
    d = remote.get("layout")
    if not isinstance(d, dict):
        raise HandshakeError(f"{who}: layout: missing")
    d = dict(d)
    for name, v in d.items():  # the peer's bytes: an int field must be an int
        if name not in ("model", "dtype", "kv_scales") and type(v) is not int:
            raise HandshakeError(f"{who}: layout: {name}: expected an int, got {v!r:.40}")
    claimed = (d.pop("head_start", None), d.pop("head_count", None))
    try:
        layout = KVLayout(**d)
    except (TypeError, ValueError) as e:  # names the field: tp_size, tp_rank, dtype, ...
        raise HandshakeError(f"{who}: layout: {e}") from None
    derived = (layout.head_start, layout.head_count)
    if claimed != derived:
        raise HandshakeError(f"{who}: layout: head_start/head_count {claimed} != {derived}, "
                             f"which rank {layout.tp_rank} of tp_size {layout.tp_size} holds "
                             f"of {layout.num_kv_heads} KV heads")
    return layout


def check(local: KVLayout, backend: str, remote: dict[str, Any], who: str) -> KVLayout:
    """Raises HandshakeError naming every differing field; ``who`` names the peer. Returns
    the peer's layout (its TP size and rank say which heads its pool holds)."""
    if remote.get("version") != PROTOCOL_VERSION:
        raise HandshakeError(f"{who}: protocol version {remote.get('version')!r} != "
                             f"{PROTOCOL_VERSION}")
    if remote.get("backend") != backend:
        raise HandshakeError(f"{who}: backend {remote.get('backend')!r} != {backend!r}")
    if remote.get("fingerprint") != local.fingerprint():
        try:
            diff = local.describe_mismatch(remote_layout(remote, who))
        except HandshakeError as e:
            diff = f"unreadable remote layout ({e})"
        raise HandshakeError(f"{who}: KV layout mismatch: {diff} "
                             f"(fingerprint {local.fingerprint()} != {remote.get('fingerprint')})")
    other = remote_layout(remote, who)
    if other.fingerprint() != local.fingerprint():  # the claimed fingerprint was not its own
        raise HandshakeError(f"{who}: KV layout mismatch: {local.describe_mismatch(other)}")
    return other
