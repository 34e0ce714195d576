"""A hand-driven control-channel peer for the hostile-input tests: raw ZMQ, no checks."""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Callable
from typing import Any

import msgpack
import zmq
from xfer_helpers import LAYOUT

from transfer import handshake, wire


def frame(kind: str, body: Any) -> bytes:
    return bytes(msgpack.packb([kind, body], use_bin_type=True))


def until(cond: Callable[[], bool], timeout: float = 10.0, what: str = "condition") -> None:
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, f"{what} not reached in {timeout} s"
        time.sleep(0.001)


def plane_info(backend: str) -> tuple[bytes, Callable[[], None]]:
    """Data-plane info a real peer would send, and how to free what made it."""
    if backend == "ipc":
        from transfer.ipc_plane import host_id

        # a peer with nothing mapped: passes the handshake, can never supply a byte
        return bytes(msgpack.packb({"host": host_id(), "pid": os.getpid(), "nbytes": 0})), \
            lambda: None
    from xfer_helpers import pool

    from transfer.pool import KVPool
    from transfer.ucx_plane import UcxPlane

    plane = UcxPlane(KVPool(pool(), LAYOUT))
    return plane.local_info(), plane.close


class RawPeer:
    """One DEALER (a producer's end) or ROUTER (a consumer's end) socket."""

    def __init__(self, address: str | None = None) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER if address else zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        if address:
            self.sock.connect(address)
            self.address = address
        else:
            port = self.sock.bind_to_random_port("tcp://127.0.0.1")
            self.address = f"tcp://127.0.0.1:{port}"

    def send(self, *frames: bytes) -> None:
        self.sock.send_multipart(list(frames))

    def recv(self, timeout: float = 10.0) -> list[bytes]:
        assert self.sock.poll(int(timeout * 1000)), "no reply"
        return list(self.sock.recv_multipart())

    def recv_kind(self, kind: wire.Kind, timeout: float = 10.0) -> wire.Message:
        """The next message of ``kind`` (heartbeats and others skipped)."""
        end = time.monotonic() + timeout
        while True:
            for m in wire.decode(self.recv(max(end - time.monotonic(), 0.01))[-1],
                                 wire.TO_PRODUCER):
                if m.KIND == kind:
                    return m

    def hello(self, backend: str, plane: bytes, token: str = "") -> list[wire.Message]:
        body = {**handshake.hello(LAYOUT, backend, plane, token), "name": "raw"}
        self.send(frame("HELLO", body))
        return wire.decode(self.recv()[-1], wire.TO_PRODUCER)

    def welcome_body(self, backend: str, plane: bytes) -> dict[str, Any]:
        return {**handshake.hello(dataclasses.replace(LAYOUT), backend, plane), "name": "raw"}

    def close(self) -> None:
        self.ctx.destroy(linger=0)
