"""NIXL data plane: one-sided WRITE of each run into the consumer's pool, with a notification.

The pool is registered once here; the consumer's agent metadata and pool base address
travel in the handshake, so the producer writes straight into the reserved blocks and
NIXL delivers the run's tag to the consumer as a notification after the data landed.
"""

from __future__ import annotations

import os
import struct
from typing import Any

import msgpack
from nixl_cu12._api import nixl_agent, nixl_agent_config

from transfer.plane import DataPlane
from transfer.pool import KVPool
from transfer.types import TransferError

_TAG = struct.Struct(">Q")


class NixlPlane(DataPlane):
    def __init__(self, pool: KVPool, name: str) -> None:
        super().__init__(pool)
        self._name = f"{name}-{os.getpid()}-{os.urandom(4).hex()}"  # unique per process
        self._agent = nixl_agent(self._name, nixl_agent_config(backends=["UCX"]))
        self._mem = "VRAM" if pool.is_cuda else "DRAM"
        self._dev = max(pool.device_index, 0)
        self._reg = self._agent.register_memory(pool.tensor)
        self._arrived: set[bytes] = set()  # notifications not yet matched to a recv

    def local_info(self) -> bytes:
        return bytes(msgpack.packb({"meta": self._agent.get_agent_metadata(),
                                    "base": self.pool.base_ptr, "mem": self._mem,
                                    "dev": self._dev}))

    def add_peer(self, info: bytes) -> object:
        d = msgpack.unpackb(info)
        name = self._agent.add_remote_agent(d["meta"])
        return (name if isinstance(name, str) else name.decode(), d["base"], d["mem"], d["dev"])

    def remove_peer(self, peer: object) -> None:
        try:
            self._agent.remove_remote_agent(peer[0])  # type: ignore[index]
        except Exception:  # noqa: S110 - a peer that is gone may already be unknown
            pass

    def send(self, peer: object, tag: int, src_block: int, dst_block: int,
             num_blocks: int) -> object:
        name, rbase, rmem, rdev = _peer(peer)
        n, bn = num_blocks * self.pool.block_nbytes, self.pool.block_nbytes
        local = self._agent.get_xfer_descs([(self.pool.base_ptr + src_block * bn, n, self._dev)],
                                           self._mem)
        remote = self._agent.get_xfer_descs([(rbase + dst_block * bn, n, rdev)], rmem)
        handle = self._agent.initialize_xfer("WRITE", local, remote, name, _TAG.pack(tag))
        if self._agent.transfer(handle) == "ERR":
            self._agent.release_xfer_handle(handle)
            raise TransferError(f"NIXL: posting WRITE of {n} bytes to {name} failed")
        return ("write", handle)

    def recv(self, peer: object, tag: int, dst_block: int | None, num_blocks: int,
             src_block: int | None = None) -> object:
        # one-sided: nothing to post; a run has landed when its notification arrives
        return ("notif", _TAG.pack(tag)) if dst_block is not None else ("done", None)

    def progress(self) -> None:
        for msgs in self._agent.get_new_notifs().values():
            self._arrived.update(msgs)

    def test(self, op: object) -> bool:
        kind, x = _op(op)
        if kind == "done":
            return True
        if kind == "notif":
            if x in self._arrived:
                self._arrived.discard(x)
                return True
            return False
        state = self._agent.check_xfer_state(x)
        if state == "PROC":
            return False
        self._agent.release_xfer_handle(x)
        if state == "ERR":
            raise TransferError("NIXL: WRITE failed")
        return True

    def close(self) -> None:
        if self._reg is not None:
            self._agent.deregister_memory(self._reg)
            self._reg = None


def _peer(p: object) -> tuple[str, int, str, int]:
    assert isinstance(p, tuple) and len(p) == 4
    return p


def _op(op: object) -> tuple[str, Any]:
    assert isinstance(op, tuple) and len(op) == 2
    return op


def available() -> tuple[bool, str]:
    """Whether NIXL loads here, and why not (for tests' skip reasons)."""
    try:
        agent: Any = nixl_agent(f"probe-{os.getpid()}", nixl_agent_config(backends=["UCX"]))
        del agent
    except Exception as e:
        return False, f"NIXL UCX backend unavailable: {e}"
    return True, ""
