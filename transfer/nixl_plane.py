"""NIXL data plane: the consumer READs each run straight out of the producer's pool.

The pool is registered once here; the producer's agent metadata and pool base address
travel in its handshake, and each announced run becomes one one-sided READ posted by the
consumer into its reserved blocks. Why READ and not WRITE: with a producer writing, a
run already on the wire when the consumer cancelled could land in blocks the consumer had
freed and handed to another request (see ``transfer.plane.PullPlane``).

Head-sliced runs (``transfer.head_cut``): one READ whose descriptor lists hold one
descriptor per pitched row on each side, straight between the two pools (NIXL takes
descriptor lists as Nx3 arrays): no staging copy on either side, and the backend posts the
rows together.
"""

from __future__ import annotations

import os
import time
from typing import Any

import msgpack
import numpy as np
from nixl_cu12._api import nixl_agent, nixl_agent_config

from transfer.head_cut import HeadCut, Rows
from transfer.plane import PullPlane
from transfer.pool import KVPool
from transfer.types import TransferError

DRAIN_S = 1.0  # how long removing a peer waits for its READs to end before aborting them


class NixlPlane(PullPlane):
    def __init__(self, pool: KVPool, name: str) -> None:
        super().__init__(pool)
        self._name = f"{name}-{os.getpid()}-{os.urandom(4).hex()}"  # unique per process
        self._agent = nixl_agent(self._name, nixl_agent_config(backends=["UCX"]))
        self._mem = "VRAM" if pool.is_cuda else "DRAM"
        self._dev = max(pool.device_index, 0)
        self._reg = self._agent.register_memory(pool.tensor)
        self._reading: dict[str, set[Any]] = {}  # peer name -> READs not yet released

    def local_info(self) -> bytes:
        return bytes(msgpack.packb({"meta": self._agent.get_agent_metadata(),
                                    "base": self.pool.base_ptr, "mem": self._mem,
                                    "dev": self._dev}))

    def add_peer(self, info: bytes) -> object:
        d = msgpack.unpackb(info)  # the peer's bytes: every field is checked before use
        if not (isinstance(d, dict) and type(d.get("meta")) is bytes
                and type(d.get("base")) is int and d["base"] >= 0
                and d.get("mem") in ("DRAM", "VRAM") and type(d.get("dev")) is int
                and d["dev"] >= 0):
            raise TransferError("NIXL: malformed peer info (meta, base, mem, dev)")
        name = self._agent.add_remote_agent(d["meta"])
        return (name if isinstance(name, str) else name.decode(), d["base"], d["mem"], d["dev"])

    def remove_peer(self, peer: object) -> None:
        # Our records on this peer end as soon as it is removed and their blocks go back to
        # the engine: no READ may still be landing in them. Wait (bounded) for each to end,
        # then release it, which aborts one still running.
        end = time.monotonic() + DRAIN_S
        for handle in self._reading.pop(peer[0], set()):  # type: ignore[index]
            while time.monotonic() < end and self._agent.check_xfer_state(handle) == "PROC":
                time.sleep(0.001)
            self._agent.release_xfer_handle(handle)
        try:
            self._agent.remove_remote_agent(peer[0])  # type: ignore[index]
        except Exception:  # noqa: S110 - a peer that is gone may already be unknown
            pass

    def read(self, peer: object, src_block: int, dst_block: int, num_blocks: int,
             cut: HeadCut | None = None) -> object:
        name, rbase, rmem, rdev = _peer(peer)
        n, bn = num_blocks * self.pool.block_nbytes, self.pool.block_nbytes
        if cut is None:
            local = self._agent.get_xfer_descs(
                [(self.pool.base_ptr + dst_block * bn, n, self._dev)], self._mem)
            remote = self._agent.get_xfer_descs([(rbase + src_block * bn, n, rdev)], rmem)
        else:
            dst = cut.dst_rows(dst_block, num_blocks)
            if dst.end > self.pool.flat.numel():
                raise TransferError(f"NIXL: run {dst_block}+{num_blocks} outside our pool")
            n = cut.nbytes(num_blocks)
            local = self._agent.get_xfer_descs(_row_descs(self.pool.base_ptr, dst, self._dev),
                                               self._mem)
            remote = self._agent.get_xfer_descs(
                _row_descs(rbase, cut.src_rows(src_block, num_blocks), rdev), rmem)
        handle = self._agent.initialize_xfer("READ", local, remote, name)
        if self._agent.transfer(handle) == "ERR":
            self._agent.release_xfer_handle(handle)
            raise TransferError(f"NIXL: posting READ of {n} bytes from {name} failed")
        self._reading.setdefault(name, set()).add(handle)
        return (name, handle)

    def test(self, op: object) -> bool:
        if op is None:
            return True
        assert isinstance(op, tuple)
        name: str = op[0]
        handle: Any = op[1]
        if handle not in self._reading.get(name, ()):
            return True  # released when its peer was removed
        try:
            state = self._agent.check_xfer_state(handle)
        except Exception as e:  # NIXL raises for a peer that went away mid-READ
            state = f"ERR ({e})"
        if state == "PROC":
            return False
        self._reading[name].discard(handle)
        self._agent.release_xfer_handle(handle)
        if state.startswith("ERR"):
            raise TransferError(f"NIXL: READ from producer agent {name} failed: {state}")
        return True

    def close(self) -> None:
        if self._reg is not None:
            self._agent.deregister_memory(self._reg)
            self._reg = None


def _row_descs(base: int, r: Rows, dev: int) -> np.ndarray:
    """One (address, length, device) descriptor per row of a pitched region."""
    out = np.empty((r.rows, 3), dtype=np.int64)
    out[:, 0] = base + r.offset + np.arange(r.rows, dtype=np.int64) * r.pitch
    out[:, 1] = r.width
    out[:, 2] = dev
    return out


def _peer(p: object) -> tuple[str, int, str, int]:
    assert isinstance(p, tuple) and len(p) == 4
    return p


def available() -> tuple[bool, str]:
    """Whether NIXL loads here, and why not (for tests' skip reasons)."""
    try:
        agent: Any = nixl_agent(f"probe-{os.getpid()}", nixl_agent_config(backends=["UCX"]))
        del agent
    except Exception as e:
        return False, f"NIXL UCX backend unavailable: {e}"
    return True, ""
