"""Same-host data plane: the consumer maps the producer's pool and pulls each run itself.

CPU pools: the producer moves its pool into shared memory once (``KVPool.share_memory``)
and the consumer maps that file through ``/proc/<pid>/fd`` and copies each run with one
memcpy. CUDA pools: the producer exports its pool allocation's IPC handle, the consumer
opens it in its own context and issues one device copy per run on its own stream (NVLink
between GPUs of one host), completion reported by an event waiter.

Why pull and not push: see ``transfer.plane.PullPlane``.

Head-sliced runs (``transfer.head_cut``): the consumer reads exactly the part's pitched
rows out of the producer's pool into its own, with no staging: one strided tensor copy on
CPU, one 2D copy (``cuMemcpy2DAsync``: source and destination pitch) on CUDA.
"""

from __future__ import annotations

import logging
import mmap
import os
from typing import Any

import msgpack

from transfer.event_waiter import EventWaiter
from transfer.head_cut import HeadCut
from transfer.plane import PullPlane
from transfer.pool import KVPool, TransferValueError, strided
from transfer.types import TransferError

log = logging.getLogger("pdserve.transfer")


def host_id() -> str:
    """Differs between hosts (and reboots): IPC only works inside one host."""
    with open("/proc/sys/kernel/random/boot_id") as f:
        return f.read().strip()


class IpcPlane(PullPlane):
    def __init__(self, pool: KVPool, exporter: bool) -> None:
        super().__init__(pool)
        self._peers: list[dict[str, Any]] = []
        self._waiter: EventWaiter | None = None
        self._unflushed: list[_Copy] = []  # copies issued since the last event
        self._info: dict[str, Any] = {"host": host_id(), "pid": os.getpid(),
                                      "nbytes": pool.flat.numel(), "block": pool.block_nbytes}
        if pool.is_cuda:
            import torch

            from transfer import cuda_driver

            cuda_driver.use_device(pool.device_index)  # driver calls below run on this thread
            torch.cuda.set_device(pool.device_index)
            self._stream = torch.cuda.Stream(pool.device_index)
            if exporter:
                base, _ = cuda_driver.allocation_of(pool.base_ptr)
                self._info.update(kind="cuda", handle=cuda_driver.export(base),
                                  offset=pool.base_ptr - base)
        elif exporter:
            fd, size = pool.share_memory()
            self._info.update(kind="cpu", fd=fd, size=size, offset=pool.storage_offset_bytes)

    def local_info(self) -> bytes:
        return bytes(msgpack.packb(self._info))

    def add_peer(self, info: bytes) -> object:
        d = _peer_info(info)
        if d.get("host") != self._info["host"]:
            raise TransferError("backend ipc: producer and consumer are on different hosts "
                                "(boot ids differ); use backend ucx or nixl between hosts")
        if "kind" not in d:
            return {"kind": "none"}  # a consumer's own info: nothing to map
        want = "cuda" if self.pool.is_cuda else "cpu"
        if d["kind"] != want:
            raise TransferError(f"backend ipc: producer pool is {d['kind']}, ours is {want}")
        nbytes, block = _count(d, "nbytes"), _count(d, "block")
        if block == 0 or nbytes % block:  # its blocks hold its own heads (TP): its size
            raise TransferError(f"backend ipc: producer pool of {nbytes} bytes is not whole "
                                f"blocks of {block}")
        offset = _count(d, "offset")
        if want == "cuda":
            from transfer import cuda_driver

            base = cuda_driver.open_handle(_field(d, "handle", bytes))
            try:
                _, size = cuda_driver.allocation_of(base)
            except TransferError as e:  # a driver that cannot size IPC mappings keeps working
                log.warning("backend ipc: cannot size the producer's mapped pool (%s); "
                            "trusting its claimed %d bytes", e, offset + nbytes)
                size = offset + nbytes
            if offset + nbytes > size:  # no device copy may read past what was mapped
                cuda_driver.close_handle(base)
                raise TransferError(f"backend ipc: producer pool (offset {offset}, {nbytes} "
                                    f"bytes) outside its {size}-byte allocation")
            peer = {"kind": "cuda", "base": base, "ptr": base + offset}
        else:
            peer = {"kind": "cpu", "flat": _map_cpu(_count(d, "pid"), _count(d, "fd"),
                                                    _count(d, "size"), offset, nbytes)}
        peer["nbytes"] = nbytes
        self._peers.append(peer)
        return peer

    def remove_peer(self, peer: object) -> None:
        assert isinstance(peer, dict)
        # by identity: == on these dicts would compare their mapped pools element-wise
        kept = [p for p in self._peers if p is not peer]
        if len(kept) < len(self._peers):
            self._peers = kept
            self._unmap(peer)

    def _unmap(self, peer: dict[str, Any]) -> None:
        if peer["kind"] == "cuda":
            from transfer import cuda_driver

            self._stream.synchronize()  # no copy may read the mapping after it is closed
            cuda_driver.close_handle(peer["base"])
        peer.pop("flat", None)  # the mapping goes with the last tensor over it

    def read(self, peer: object, src_block: int, dst_block: int, num_blocks: int,
             cut: HeadCut | None = None) -> object:
        assert isinstance(peer, dict)
        if cut is not None:
            return self._read_cut(peer, src_block, dst_block, num_blocks, cut)
        bn = self.pool.block_nbytes
        n, d, s = num_blocks * bn, dst_block * bn, src_block * bn
        if min(src_block, dst_block) < 0 or num_blocks <= 0 or s + n > peer.get("nbytes", 0) \
                or d + n > self.pool.flat.numel():
            raise TransferError(f"backend ipc: source run {src_block}+{num_blocks} outside "
                                "the producer's pool")
        if peer["kind"] == "cpu":
            self.pool.flat[d:d + n].copy_(peer["flat"][s:s + n])
            return None

        from transfer import cuda_driver

        # one DMA per run on the copy engine: reaches the link's peak on large runs and
        # leaves the SMs to the consumer's decode (a Triton pull of a whole announce over
        # NVLink was measured slower: bench/RESULTS.md)
        cuda_driver.copy_async(self.pool.base_ptr + d, peer["ptr"] + s, n,
                               self._stream.cuda_stream)
        op = _Copy()
        self._unflushed.append(op)
        return op

    def _read_cut(self, peer: dict[str, Any], src_block: int, dst_block: int,
                  num_blocks: int, cut: HeadCut) -> object:
        src, dst = cut.src_rows(src_block, num_blocks), cut.dst_rows(dst_block, num_blocks)
        if min(src_block, dst_block) < 0 or num_blocks <= 0 or src.end > peer.get("nbytes", 0):
            raise TransferError(f"backend ipc: source run {src_block}+{num_blocks} outside "
                                "the producer's pool")
        try:
            into = strided(self.pool.flat, dst)  # checks our bounds on CUDA too
            if peer["kind"] == "cpu":
                into.copy_(strided(peer["flat"], src))
                return None
        except TransferValueError as e:
            raise TransferError(f"backend ipc: {e}") from None
        from transfer import cuda_driver

        cuda_driver.copy_2d_async(self.pool.base_ptr + dst.offset, dst.pitch,
                                  peer["ptr"] + src.offset, src.pitch, dst.width, dst.rows,
                                  self._stream.cuda_stream)
        op = _Copy()
        self._unflushed.append(op)
        return op

    def flush(self) -> None:
        """One event for all copies of a loop turn: a run is often a few microseconds of
        NVLink time, less than an event record and a waiter hand-off cost on the host."""
        if not self._unflushed:
            return
        import torch

        ev = torch.cuda.Event()
        ev.record(self._stream)
        for op in self._unflushed:
            op.event = ev
        self._unflushed.clear()
        if self._waiter is None:
            self._waiter = EventWaiter(self.wake, "kv-ipc-events")
        self._waiter.add(ev)

    def test(self, op: object) -> bool:
        if op is None:
            return True
        assert isinstance(op, _Copy)
        if op.event is None:
            self.flush()
        return bool(op.event.query())  # type: ignore[union-attr]

    def close(self) -> None:
        if self._waiter is not None:
            self._waiter.close()
            self._waiter = None
        for peer in self._peers:
            self._unmap(peer)
        self._peers.clear()


class _Copy:
    """A run's device copy; done when the event recorded after it (``flush``) is."""

    __slots__ = ("event",)

    def __init__(self) -> None:
        self.event: Any = None


def _peer_info(info: bytes) -> dict[str, Any]:
    try:
        d = msgpack.unpackb(info)
    except Exception as e:
        raise TransferError(f"backend ipc: unreadable peer info ({type(e).__name__})") from None
    if not isinstance(d, dict):
        raise TransferError("backend ipc: peer info is not a map")
    return d


def _field(d: dict[str, Any], name: str, typ: type) -> Any:
    v = d.get(name)
    if type(v) is not typ:
        raise TransferError(f"backend ipc: peer info {name}: expected {typ.__name__}")
    return v


def _count(d: dict[str, Any], name: str) -> int:
    v = _field(d, name, int)
    if not 0 <= v < 1 << 62:
        raise TransferError(f"backend ipc: peer info {name}: {v} out of range")
    return int(v)


def _map_cpu(pid: int, fd: int, size: int, offset: int, nbytes: int) -> Any:
    """Maps exactly the producer's pool: every size and offset it claimed is checked
    against the file itself, so no read can run past the mapping (SIGBUS) or the pool."""
    import torch

    try:
        f = os.open(f"/proc/{pid}/fd/{fd}", os.O_RDWR)
    except OSError as e:
        raise TransferError(f"backend ipc: cannot open the producer's shared pool "
                            f"(pid {pid}, fd {fd}): {e}") from None
    try:
        real = os.fstat(f).st_size
        if not offset + nbytes <= size <= real or nbytes == 0:
            raise TransferError(f"backend ipc: producer pool (offset {offset}, {nbytes} "
                                f"bytes, mapping {size}) does not fit its {real}-byte file")
        mm = mmap.mmap(f, size)
    finally:
        os.close(f)
    return torch.frombuffer(mm, dtype=torch.uint8)[offset:offset + nbytes]
