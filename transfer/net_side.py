"""What the network sender and receiver share: the status mirror, record endings, the plane.

Records live on the I/O thread. A lock-guarded mirror of their statuses lets ``status`` and
``release`` answer on the caller's thread without a round trip.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable
from typing import Any, Generic, TypeVar

import zmq
from zmq.utils.monitor import recv_monitor_message

from engine.kv_layout import KVLayout
from transfer import curve, plane_probe
from transfer.head_cut import HeadCut
from transfer.io_loop import IOLoop
from transfer.plane import DataPlane
from transfer.pool import KVPool
from transfer.records import Record
from transfer.types import (
    TransferConfig,
    TransferError,
    TransferStats,
    TransferStatus,
    TransferUpdate,
)
from transfer.ucx_net import restrict_to_host
from transfer.wire import MAX_FRAME_BYTES, Kind, MalformedMessage, Message

log = logging.getLogger("pdserve.transfer")
MAX_VETTING = 8  # handshakes whose data-plane info is being vetted at once
# Control frames a socket holds unsent/unread per peer: a peer that stops reading is cut off
# at this mark (the sender drops the connection on EAGAIN) instead of growing our memory.
CONTROL_HWM = 4096
LOG_EVERY_S = 1.0  # a flood of bad frames logs one line a second per side, with a count

R = TypeVar("R", bound=Record[Any])
Handler = Callable[[Any, Any], None]  # (peer or connection, message)


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


class NetSide(IOLoop, Generic[R]):
    def __init__(self, tensor: object, layout: KVLayout, config: TransferConfig,
                 name: str) -> None:
        super().__init__(name)
        self.pool = KVPool(tensor, layout)  # type: ignore[arg-type]
        self.layout = layout
        self.config = config
        self.name = name
        self.plane: DataPlane | None = None
        self.recs: dict[str, R] = {}
        self.handlers: dict[Kind, Handler] = {}  # filled by each side: one dispatch table
        self._malformed = 0
        self.payload_bytes = 0  # added to on the I/O thread only
        self._rejected = 0
        self._last_log = 0.0
        self._unlogged = 0
        # Without a cluster token any stranger can hand us data-plane info, and UCX aborts
        # the process on a malformed worker address: vet it in a child first (plane_probe).
        # NIXL checks the agent metadata it loads (garbage raises), ipc checks its own.
        if config.backend in ("ucx", "nixl"):
            # before any UCX context here or in the probe's child: UCX listens on every
            # device it may use, and the operator named one address (transfer/ucx_net.py)
            restrict_to_host(config.host)
        self._probe = None
        if config.backend == "ucx" and not config.cluster_token:
            self._probe = plane_probe.shared(config.backend)
            self._probe.warm()
        self._vetting = 0
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

    def stats(self) -> TransferStats:
        # int reads: no lock needed
        return TransferStats(self._malformed, self._rejected, self.payload_bytes)

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
    def control_socket(self, kind: int) -> Any:
        """A control socket that refuses frames over the size limit (libzmq drops the
        connection that sends one), never lingers on close and, with a cluster token,
        speaks CURVE (the consumer's ROUTER is the server)."""
        sock = self.zctx.socket(kind)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME_BYTES)
        sock.setsockopt(zmq.SNDHWM, CONTROL_HWM)
        sock.setsockopt(zmq.RCVHWM, CONTROL_HWM)
        curve.secure(sock, self.config, server=kind == zmq.ROUTER)
        return sock

    def watch_handshakes(self, sock: Any) -> Any:
        """A monitor socket, polled by the loop, that reports failed ZMQ handshakes."""
        mon = sock.get_monitor_socket(events=curve.HANDSHAKE_FAILED)
        self.poller.register(mon, zmq.POLLIN)
        return mon

    def failed_handshakes(self, mon: Any) -> list[int]:
        """The events of the failed ZMQ handshakes ``mon`` reported since the last call."""
        events: list[int] = []
        while True:
            try:
                events.append(int(recv_monitor_message(mon, flags=zmq.NOBLOCK)["event"]))
            except zmq.Again:
                return events

    def unwatch(self, sock: Any, mon: Any) -> None:
        self.poller.unregister(mon)
        sock.disable_monitor()
        mon.close(0)

    def vet_then(self, info: bytes, then: Callable[[str | None], None]) -> bool:
        """Calls ``then(error)`` on this thread once a peer's data-plane info was vetted
        (at once where no vetting is needed); False if too many vets are pending."""
        probe = self._probe
        if probe is None:
            then(None)
            return True
        if self._vetting >= MAX_VETTING:
            return False
        self._vetting += 1

        def run() -> None:
            try:
                probe.vet(info)
                err = None
            except TransferError as e:
                err = str(e)

            def back() -> None:
                self._vetting -= 1
                then(err)

            with contextlib.suppress(RuntimeError):  # the loop died or closed meanwhile
                self.call(back)

        threading.Thread(target=run, name=f"{self.name}-vet", daemon=True).start()
        return True

    def dispatch(self, peer: object, msgs: list[Message], who: str,
                 current: Callable[[], bool]) -> None:
        """Runs each message's handler while ``peer`` is still the current session (a
        handler may drop it); a message that breaks a handler's checks (or a handler) is
        dropped and counted, and the I/O thread carries on."""
        for m in msgs:
            if not current():
                return
            try:
                self.handlers[m.KIND](peer, m)
            except MalformedMessage as e:
                self.malformed(who, str(e))
            except Exception as e:  # a bad message must never end the I/O thread
                log.exception("%s: handling %s from %s failed", self.name, m.KIND.value, who)
                self.malformed(who, f"{m.KIND.value}: handler raised {type(e).__name__}: {e}")

    def malformed(self, who: str, why: str) -> None:
        """Counts a dropped frame or message and logs it (rate-limited) naming the peer."""
        self._malformed += 1
        self._log_dropped(who, f"malformed message dropped: {why}")

    def rejected(self, who: str, why: str) -> None:
        self._rejected += 1
        self._log_dropped(who, f"handshake refused: {why}")

    def _log_dropped(self, who: str, what: str) -> None:
        now = time.monotonic()
        if now - self._last_log < LOG_EVERY_S:
            self._unlogged += 1
            return
        more = f" (+{self._unlogged} more since the last line)" if self._unlogged else ""
        self._last_log, self._unlogged = now, 0
        log.warning("%s: from %s: %s%s", self.name, who, what[:300], more)

    def set_status(self, rec: R, st: TransferStatus) -> None:
        rec.status = st
        with self._mlock:
            if rec.request_id in self._mirror:
                self._mirror[rec.request_id] = st

    def end(self, rec: R, st: TransferStatus, reason: str, notify: bool) -> None:
        """Starts ending ``rec``: it turns ``st`` once its posted ops drain."""
        if rec.status.terminal or rec.ending is not None:
            return
        rec.ending, rec.ending_since = (st, reason), time.monotonic()
        if notify:
            self.notify_cancel(rec, reason)

    def finalize(self, rec: R, st: TransferStatus, error: str | None) -> None:
        rec.ops.clear()
        self.set_status(rec, st)
        self.report(self.outcome(rec, st, error))

    def outcome(self, rec: R, st: TransferStatus, error: str | None) -> TransferUpdate:
        """The terminal update ``poll`` hands out for ``rec``."""
        notice = rec.notice if st == TransferStatus.DONE else None
        return TransferUpdate(rec.request_id, st, notice, error)

    def step_record(self, rec: R, now: float) -> bool:
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
            if rec.drained():
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
            peers = rec.peers()
            if rec.status.terminal or not any(p is peer for p in peers):
                continue
            self.peer_gone(rec, peer)
            st = rec.ending[0] if rec.ending else TransferStatus.FAILED
            if all(p is peer for p in peers):
                # the peer's ops were cancelled with it: nothing can touch the blocks now
                self.finalize(rec, st, f"{rec.ending[1]}; {reason}" if rec.ending else reason)
            else:  # other ranks' parts may still be moving: end the whole once they drain
                self.end(rec, st, reason, notify=True)

    def run_nbytes(self, num_blocks: int, cut: HeadCut | None) -> int:
        """Payload of one run: whole blocks, or only the cut's heads."""
        return num_blocks * self.pool.block_nbytes if cut is None else cut.nbytes(num_blocks)

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

    def notify_cancel(self, rec: R, reason: str) -> None:
        """Tells the peers to stop (sends CANCEL on the control channel)."""

    def peer_gone(self, rec: R, peer: object) -> None:
        """``peer`` of ``rec`` is gone (dropped): it is told nothing more."""
