"""The ZMQ (IPC) link between a worker's gRPC process and its engine process.

The messages and their codec are in ``worker.messages``. Commands flow gRPC -> engine on one
PUSH/PULL pair, events flow engine -> gRPC on another, so neither side ever blocks the other.
"""

from __future__ import annotations

import os
import tempfile
import uuid
from dataclasses import dataclass

import zmq

# Messages each side of the link may hold unsent/unread (ZMQ's high-water marks, set on
# both ends): past it the engine's event send waits for the gRPC process (backpressure on
# the engine, which only happens if that process stalls), and the gRPC process refuses
# new requests (EngineBusy) instead of queueing them without bound.
HWM = 10_000


@dataclass(frozen=True)
class IpcPaths:
    commands: str  # zmq endpoint, gRPC process PUSHes, engine PULLs
    events: str  # engine PUSHes, gRPC process PULLs

    @staticmethod
    def fresh() -> IpcPaths:
        base = os.path.join(tempfile.gettempdir(), f"pdserve-{uuid.uuid4().hex[:12]}")
        return IpcPaths(f"ipc://{base}-cmd", f"ipc://{base}-evt")

    def cleanup(self) -> None:
        for ep in (self.commands, self.events):
            try:
                os.unlink(ep.removeprefix("ipc://"))
            except FileNotFoundError:
                pass


def bind_pull(ctx: zmq.Context, endpoint: str) -> zmq.Socket:
    s = ctx.socket(zmq.PULL)
    s.setsockopt(zmq.RCVHWM, HWM)
    s.bind(endpoint)
    return s


def connect_push(ctx: zmq.Context, endpoint: str) -> zmq.Socket:
    s = ctx.socket(zmq.PUSH)
    s.setsockopt(zmq.LINGER, 0)
    s.setsockopt(zmq.SNDHWM, HWM)
    s.connect(endpoint)
    return s
