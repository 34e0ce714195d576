"""CURVE keys of the KV control channel, derived from the cluster token.

The consumer's ROUTER is a CURVE server whose key pair is a pure function of the token;
a producer derives the server's public key from its own token and opens a fresh key pair
per connection. A producer with another token (or none) cannot finish the ZMQ handshake,
so it never reaches our decoder, and nothing of the control channel (the token in the
HELLO included) crosses the network in clear. KV bytes on the data plane (UCX / NIXL inside
the cluster network, or same-host IPC) are not encrypted: they would cost a copy per byte.
"""

from __future__ import annotations

import functools
import hashlib
from typing import Any

import zmq
from zmq.utils import z85

from transfer.types import TransferConfig, TransferError

_SALT = b"pdserve kv control channel curve v1"
# a slow derivation: a sniffed handshake lets an observer test token guesses offline
_ROUNDS = 100_000
HANDSHAKE_FAILED = (zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                    | zmq.EVENT_HANDSHAKE_FAILED_AUTH)


def handshake_failure(events: list[int]) -> str:
    """Why ZMQ handshakes failed, as far as the monitor's events tell. A wrong CURVE key shows
    as "no detail", as does a peer that died mid-handshake (seen when a TP consumer rank was
    killed during a transfer), so that message names both."""
    if any(e & zmq.EVENT_HANDSHAKE_FAILED_AUTH for e in events):
        return "authentication failed (a wrong cluster token)"
    if any(e & zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL for e in events):
        return ("a protocol error (a cluster token, so CURVE, on one side only; or a peer "
                "that does not speak pdserve's KV protocol)")
    return ("no detail from ZMQ: a wrong or missing cluster token, or the peer closed the "
            "connection during the handshake (it stopped or restarted)")


def enabled(config: TransferConfig) -> bool:
    return bool(config.cluster_token) and config.curve


@functools.cache
def server_keys(token: str) -> tuple[bytes, bytes]:
    """(public, secret), z85-encoded, of the consumer's CURVE server."""
    seed = hashlib.pbkdf2_hmac("sha256", token.encode(), _SALT, _ROUNDS, 32)
    secret = z85.encode(seed)
    return zmq.curve_public(secret), secret


def secure(sock: Any, config: TransferConfig, server: bool) -> None:
    """Turns CURVE on for ``sock`` when the config asks for it (before bind/connect)."""
    if not enabled(config):
        return
    if not zmq.has("curve"):
        raise TransferError("cluster_token: this libzmq has no CURVE support; set "
                            "curve=False to send the token in clear")
    public, secret = server_keys(config.cluster_token)
    if server:
        sock.curve_server = True
        sock.curve_publickey, sock.curve_secretkey = public, secret
    else:
        sock.curve_serverkey = public
        sock.curve_publickey, sock.curve_secretkey = zmq.curve_keypair()
