"""The links between a worker's gRPC process and its engine process.

The messages and their codec are in ``worker.messages``. Commands flow gRPC -> engine on a
ZMQ PUSH/PULL pair; events flow engine -> gRPC on a Unix stream socket read by the gRPC
process's loop (worker/event_link.py says why not ZMQ there), so neither side ever waits
on the other but for a stalled peer.
"""

from __future__ import annotations

import os
import tempfile
import uuid
from dataclasses import dataclass

import zmq

from worker import event_link

# Commands each side of the commands link may hold unsent/unread (ZMQ's high-water marks,
# set on both ends): past it the gRPC process refuses new requests (EngineBusy) instead of
# queueing them without bound. (The events link bounds its writer in bytes:
# event_link.MAX_PENDING.)
HWM = 10_000


@dataclass(frozen=True)
class IpcPaths:
    commands: str  # zmq endpoint, gRPC process PUSHes, engine PULLs
    events: str  # a Unix socket's path (event_link.py): engine writes, gRPC process reads

    @staticmethod
    def fresh() -> IpcPaths:
        base = os.path.join(tempfile.gettempdir(), f"pdserve-{uuid.uuid4().hex[:12]}")
        return IpcPaths(f"ipc://{base}-cmd", event_link.fresh_path())

    def cleanup(self) -> None:
        for path in (self.commands.removeprefix("ipc://"), self.events):
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
        try:  # the events socket's own directory
            os.rmdir(os.path.dirname(self.events))
        except OSError:
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
