"""The ZMQ (IPC) link between a worker's gRPC process and its engine process.

Messages are msgpack lists ``[kind, request_id, *fields]``: compact, and cheap to encode on
the engine's hot path. Commands flow gRPC -> engine on one PUSH/PULL pair, events flow
engine -> gRPC on another, so neither side ever blocks the other.
"""

from __future__ import annotations

import os
import tempfile
import uuid
from dataclasses import dataclass
from typing import Any

import msgpack
import zmq

# Commands (gRPC process -> engine process)
CMD_PREFILL = "prefill"  # [rid, prompt_ids, sampling dict, received_ns]
CMD_DESTINATION = "dest"  # [rid, consumer_id, kv_address, block_ids]
CMD_DECODE = "decode"  # [rid, prompt_ids, sampling dict, colocated]
CMD_TOKEN0_SENT = "t0sent"  # [rid]: token 0 is on its way to the router
CMD_ABORT = "abort"  # [rid]
CMD_STOP = "stop"  # ["", ]
# Events (engine process -> gRPC process)
EV_READY = "ready"  # ["", info dict]
EV_TOKEN0 = "token0"  # [rid, dict]
EV_TRANSFER = "transfer"  # [rid, ok, error, kv_transfer_ms]
EV_RESERVED = "reserved"  # [rid, kv_address, block_ids]
EV_TOKENS = "tokens"  # [rid, dict]
EV_STATS = "stats"  # ["", load dict]
EV_FATAL = "fatal"  # ["", error]


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


def pack(kind: str, rid: str, *fields: Any) -> bytes:
    return msgpack.packb([kind, rid, *fields], use_bin_type=True)


def unpack(data: bytes) -> list[Any]:
    out: list[Any] = msgpack.unpackb(data, raw=False)
    return out


def bind_pull(ctx: zmq.Context, endpoint: str) -> zmq.Socket:
    s = ctx.socket(zmq.PULL)
    s.bind(endpoint)
    return s


def connect_push(ctx: zmq.Context, endpoint: str) -> zmq.Socket:
    s = ctx.socket(zmq.PUSH)
    s.setsockopt(zmq.LINGER, 0)
    s.connect(endpoint)
    return s
