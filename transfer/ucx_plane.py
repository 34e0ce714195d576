"""UCX data plane through ucxx: tag send/recv straight from/into the KV pool.

Why tag messaging and not a one-sided put: the ucxx Python API exposes no memory handles
or rkeys. The receiver posts each run's receive only after the sender announced it on the
control channel, so every posted receive is matched by a send already in flight and
completes, and a run the consumer no longer wants drains into a 1-byte buffer (UCX
completes a truncated receive and its send without moving the payload).

Endpoint error handling is OFF: with it on UCX refuses shared memory (TCP only, ~10x
slower). Liveness therefore comes from the control channel's heartbeats, and a dead
peer's endpoint is closed, which cancels every operation posted on it.
UCX's registration cache registers the pool on first use and keeps it (ucxx exposes no
explicit mem_map); CPU transports (cma, tcp) need none, cuda_ipc caches its handles.

Head-sliced runs (producer and consumer of different TP, ``transfer.head_cut``): the part's
heads of a run are thousands of small pitched rows. ucxx's tag API takes one contiguous
buffer per message (no iov datatype), so the sender gathers the rows into a staging
buffer of exactly the payload and sends that, and the receiver receives into its own
staging buffer and scatters it into the pool before the run counts as landed. One
message per run either way, and only the part's bytes cross the wire.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch
import ucxx._lib.libucxx as ucx
from ucxx._lib.arr import Array

from transfer.head_cut import HeadCut
from transfer.io_loop import name_os_thread
from transfer.plane import DataPlane
from transfer.pool import KVPool, strided
from transfer.types import TransferError

# The progress thread's longest sleep. UCX wakes it for every event it has (a completion,
# an incoming message; a request posted through delayed submission signals the worker),
# so this bounds only what nothing signals. It was 1 ms: a thousand wakeups a second in
# every worker, idle or not, each a full ucp_worker_progress next to the engine's thread
# (on GPUs, with the pool's CUDA context current).
EPOLL_TIMEOUT_MS = 100


class UcxPlane(DataPlane):
    def __init__(self, pool: KVPool, progress: str = "thread") -> None:
        super().__init__(pool)
        self._ctx = ucx.UCXContext(feature_flags=(ucx.Feature.TAG, ucx.Feature.WAKEUP))
        # delayed submission: requests made on our I/O thread are posted by the progress
        # thread, the only thread that touches the UCX worker
        self._worker = ucx.UCXWorker(self._ctx, enable_delayed_submission=True)
        self._worker.set_progress_thread_start_callback(
            _progress_thread_start, cb_args=(pool.device_index if pool.is_cuda else -1,))
        # a C++ thread progresses without the GIL; "thread" sleeps in epoll between events,
        # which measured faster than spinning on a 2-core host (spinners steal the core)
        self._worker.start_progress_thread(polling_mode=progress == "thread-polling",
                                           epoll_timeout=EPOLL_TIMEOUT_MS)
        self._discard = np.zeros(1, dtype=np.uint8)
        self._closed = False
        self._stream: Any = None  # CUDA pools: gathers and scatters of head-sliced runs

    def local_info(self) -> bytes:
        return bytes(self._worker.address.tobytes())

    def add_peer(self, info: bytes) -> object:
        addr = ucx.UCXAddress.create_from_buffer(info)
        return ucx.UCXEndpoint.create_from_worker_address(self._worker, addr, False)

    def remove_peer(self, peer: object) -> None:
        peer.close()  # type: ignore[attr-defined]

    def send(self, peer: object, tag: int, src_block: int, dst_block: int,
             num_blocks: int, cut: HeadCut | None = None) -> object:
        if cut is None:
            buf = Array(self.pool.view(src_block, num_blocks))
        else:  # gather the part's rows: the staging buffer lives in the op until sent
            rows = strided(self.pool.flat, cut.src_rows(src_block, num_blocks))
            buf = Array(self._host_or_device(lambda: rows.contiguous().view(-1)))
        return (peer.tag_send(buf, ucx.UCXXTag(tag)), buf, False,  # type: ignore[attr-defined]
                None)

    def recv(self, peer: object, tag: int, dst_block: int | None, num_blocks: int,
             src_block: int, cut: HeadCut | None = None) -> object:
        discard = dst_block is None
        land = None
        if dst_block is None:
            buf = Array(self._discard)
        elif cut is None:
            buf = Array(self.pool.view(dst_block, num_blocks))
        else:
            rows = strided(self.pool.flat, cut.dst_rows(dst_block, num_blocks))
            staging = torch.empty(rows.shape, dtype=torch.uint8, device=self.pool.flat.device)
            buf = Array(staging.view(-1) if self.pool.is_cuda else staging.view(-1).numpy())

            def land() -> None:  # scatter into the pool once the payload is in
                self._host_or_device(lambda: rows.copy_(staging))

        req = peer.tag_recv(buf, ucx.UCXXTag(tag), ucx.UCXXTagMaskFull)  # type: ignore[attr-defined]
        return (req, buf, discard, land)  # the Array keeps the buffer alive while UCX uses it

    def _host_or_device(self, fn: Callable[[], torch.Tensor]) -> Any:
        """Runs a gather/scatter; on CUDA on our own stream, waited for before UCX reads
        (or the run is reported landed), so no byte is read before it is written."""
        if not self.pool.is_cuda:
            return fn().numpy()
        if self._stream is None:
            self._stream = torch.cuda.Stream(self.pool.device_index)
        with torch.cuda.stream(self._stream):
            out = fn()
        self._stream.synchronize()
        return out

    def test(self, op: object) -> bool:
        assert isinstance(op, tuple)
        req: Any = op[0]
        discard: bool = op[2]
        land: Callable[[], None] | None = op[3]
        if not req.completed:
            return False
        try:
            req.check_error()
        except ucx.UCXMessageTruncatedError:
            if not discard:
                raise TransferError("UCX: run larger than its destination (truncated)") from None
            return True
        except ucx.UCXError as e:
            raise TransferError(f"UCX {type(e).__name__}: {e}") from None
        if land is not None:
            land()
        return True

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._worker.stop_progress_thread()


def _progress_thread_start(device: int) -> None:
    name_os_thread("ucx-progress")
    if device < 0:
        return
    # the progress thread must have the pool's CUDA context current for cuda_ipc
    import torch

    torch.cuda.set_device(device)
    torch.cuda.current_stream(device)
