"""What the network sender and receiver share: the status mirror, record endings, the plane.

Records live on the I/O thread. A lock-guarded mirror of their statuses lets ``status`` and
``release`` answer on the caller's thread without a round trip.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

from engine.kv_layout import KVLayout
from transfer.io_loop import IOLoop
from transfer.plane import DataPlane
from transfer.pool import KVPool
from transfer.types import TransferConfig, TransferNotice, TransferStatus, TransferUpdate

MAX_TAG_SEQ = 1 << 32  # tags are (session << 32) | seq


@dataclass
class Record:
    """One request's transfer as one side sees it (I/O thread only)."""

    request_id: str
    deadline: float  # time.monotonic() value
    peer: object | None = None  # the connection / ZMQ identity it talks to
    status: TransferStatus = TransferStatus.PENDING
    ops: list[object] = field(default_factory=list)  # posted data-plane ops not completed
    runs: int = 0  # runs sent (sender) / landed (receiver)
    total: int | None = None  # runs in the whole transfer, known at finish
    notice: TransferNotice | None = None
    acked: bool = False  # sender: the consumer acknowledged everything
    ending: tuple[TransferStatus, str] | None = None  # terminal status once ops drain
    ending_since: float = 0.0
    # sender on a pull plane: a record it ended keeps its source blocks until the
    # consumer answered (it may still be reading them)
    await_peer: bool = False
    stop_to: object | None = None  # receiver: the producer to tell STOPPED once drained


def make_plane(config: TransferConfig, pool: KVPool, name: str, exporter: bool) -> DataPlane:
    """``exporter``: the producer's side (its pool is what moves)."""
    # imported here so that only the chosen backend's library is loaded
    if config.backend == "ipc":
        from transfer.ipc_plane import IpcPlane

        return IpcPlane(pool, exporter)
    if config.backend == "ucx":
        from transfer.ucx_plane import UcxPlane

        return UcxPlane(pool, config.ucx_progress)
    if config.backend == "nixl":
        from transfer.nixl_plane import NixlPlane

        return NixlPlane(pool, name)
    raise ValueError(f"backend: {config.backend!r} has no network data plane")


class NetSide(IOLoop):
    def __init__(self, tensor: object, layout: KVLayout, config: TransferConfig,
                 name: str) -> None:
        super().__init__(name)
        self.pool = KVPool(tensor, layout)  # type: ignore[arg-type]
        self.layout = layout
        self.config = config
        self.name = name
        self.plane: DataPlane | None = None
        self.recs: dict[str, Record] = {}
        self._mirror: dict[str, TransferStatus] = {}
        self._mlock = threading.Lock()
        self._stashed: list[TransferUpdate] = []
        self._closed = False

    # ---- caller side -------------------------------------------------------------
    def poll(self) -> list[TransferUpdate]:
        if self.error is not None:  # a dead I/O thread must fail the service, not stall it
            raise RuntimeError(f"{self.name}: transfer I/O thread died: {self.error!r}") \
                from self.error
        return self._take_stashed() + self.take_updates()  # type: ignore[attr-defined]

    def status(self, request_id: str) -> TransferStatus:
        with self._mlock:
            return self._mirror[request_id]

    def release(self, request_id: str) -> None:
        with self._mlock:
            st = self._mirror.get(request_id)
            if st is None:
                return
            if not st.terminal:
                raise ValueError(f"release({request_id!r}): status {st.name} is not terminal; "
                                 "cancel() it and wait for poll() to report it")
            del self._mirror[request_id]
        self.call(lambda: self._forget(request_id))

    def _forget(self, request_id: str) -> None:
        self.recs.pop(request_id, None)

    def _mirror_new(self, request_id: str) -> TransferStatus | None:
        """Adds a PENDING mirror entry; returns the previous status if the request exists."""
        with self._mlock:
            prev = self._mirror.get(request_id)
            if prev is None:
                self._mirror[request_id] = TransferStatus.PENDING
            return prev

    def cancel(self, request_id: str, reason: str = "cancelled") -> None:
        self.call(lambda: self.cancel_now(request_id, reason))

    def cancel_now(self, request_id: str, reason: str) -> None:
        rec = self.recs.get(request_id)
        if rec is not None:
            self.end(rec, TransferStatus.CANCELLED, reason, notify=True)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self.error is None:
            try:
                self.call_sync(self.shutdown, timeout=10.0)
            except Exception:  # noqa: S110 - closing must finish even if the loop broke
                pass
        self.stop()

    # ---- loop side ---------------------------------------------------------------
    def set_status(self, rec: Record, st: TransferStatus) -> None:
        rec.status = st
        with self._mlock:
            if rec.request_id in self._mirror:
                self._mirror[rec.request_id] = st

    def end(self, rec: Record, st: TransferStatus, reason: str, notify: bool) -> None:
        """Starts ending ``rec``: it turns ``st`` once its posted ops drain."""
        if rec.status.terminal or rec.ending is not None:
            return
        rec.ending, rec.ending_since = (st, reason), time.monotonic()
        if notify:
            self.notify_cancel(rec, reason)

    def finalize(self, rec: Record, st: TransferStatus, error: str | None) -> None:
        rec.ops.clear()
        self.set_status(rec, st)
        notice = rec.notice if st == TransferStatus.DONE else None
        self.report(TransferUpdate(rec.request_id, st, notice, error))

    def step_record(self, rec: Record, now: float) -> bool:
        """Tests ``rec``'s ops and ends it on error/deadline; True if it stays undrained
        past the peer timeout (the caller then drops the peer, which cancels its ops)."""
        assert self.plane is not None
        # Ops complete in about the order they were posted: test up to the first one still
        # running and leave the rest for a later turn. Testing every op on every turn made
        # a turn O(runs in flight): tens of microseconds each, milliseconds per turn.
        done = 0
        for op in rec.ops:
            try:
                if not self.plane.test(op):
                    break
                if self.counts_landing():
                    rec.runs += 1
            except Exception as e:  # a failed run ends the record; the peer is told
                self.end(rec, TransferStatus.FAILED, f"data plane: {e}", notify=True)
            done += 1
        del rec.ops[:done]
        if rec.ending is not None:
            if not rec.ops and not rec.await_peer:
                self.finalize(rec, *rec.ending)
                return False
            return now - rec.ending_since > self.config.peer_timeout_s
        if now > rec.deadline:
            self.end(rec, TransferStatus.TIMED_OUT,
                     f"deadline passed with {rec.runs} of {rec.total or '?'} runs done",
                     notify=True)
        return False

    def fail_peer_records(self, peer: object, reason: str) -> None:
        for rec in self.recs.values():
            if rec.peer is peer and not rec.status.terminal:
                # the peer's ops were cancelled with it: nothing can touch the blocks now
                st = rec.ending[0] if rec.ending else TransferStatus.FAILED
                self.finalize(rec, st, f"{rec.ending[1]}; {reason}" if rec.ending else reason)

    def ops_in_flight(self) -> int:
        return sum(len(r.ops) for r in self.recs.values())

    def busy(self) -> bool:
        return any(r.ops or r.ending for r in self.recs.values())

    def shutdown(self) -> None:
        for rec in self.recs.values():
            if not rec.status.terminal:
                self.notify_cancel(rec, f"{self.name} closed")
                self.finalize(rec, TransferStatus.FAILED, f"{self.name} closed")

    def on_stop(self) -> None:
        if self.plane is not None:
            self.plane.close()

    # ---- hooks -------------------------------------------------------------------
    def counts_landing(self) -> bool:
        """Receiver: a completed op is a landed run. Sender: runs are counted when sent."""
        return False

    def notify_cancel(self, rec: Record, reason: str) -> None:
        """Tells the peer to stop (sends CANCEL on the control channel)."""
