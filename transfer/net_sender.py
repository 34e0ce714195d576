"""Producer side over the network: one ZMQ DEALER per consumer, a data plane for bytes.

Connecting never blocks the caller: ``connect`` queues the handshake on the I/O thread and
returns (unless given a ``timeout`` to wait for it); pushes and finishes to a consumer
still handshaking wait on its connection and go out on WELCOME, and a handshake that fails
or gets no answer within ``connect_timeout_s`` fails each of them through ``poll()``.

A producer rank of TP a may push one request to several consumer ranks of TP b (one
``Leg`` each): each consumer rank gets exactly the heads ``transfer.tp_plan`` gives it from
this rank, and the request is DONE once every one of them acknowledged.
"""

from __future__ import annotations

import collections
import re
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import replace
from typing import Any

import zmq

from engine.kv_layout import KVLayout
from transfer import wire
from transfer.base import KVSender
from transfer.event_waiter import EventWaiter
from transfer.net_side import make_plane
from transfer.pool import BlockRun, block_runs
from transfer.records import Conn, Leg, SendRecord
from transfer.sender_conns import SenderConnections
from transfer.types import (
    Accounting,
    TransferConfig,
    TransferError,
    TransferNotice,
    TransferStatus,
)
from transfer.wire import Kind, MalformedMessage

_ADDRESS = re.compile(r"tcp://(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9_.-]+):(\d{1,5})")
_HANDSHAKE_REPLIES = frozenset({Kind.WELCOME, Kind.REJECT})


class NetSender(SenderConnections, KVSender):
    def __init__(self, tensor: object, layout: KVLayout, config: TransferConfig,
                 name: str = "producer") -> None:
        super().__init__(tensor, layout, config, name)
        # pushes/finishes in call order; the head waits for its CUDA event, if any
        self._queue: collections.deque[tuple[Any, Callable[[], None]]] = collections.deque()
        self._waiter: EventWaiter | None = None  # CUDA pools: wakes the loop per event
        self.handlers = {Kind.WELCOME: self._on_welcome, Kind.REJECT: self._on_reject,
                         Kind.ACK: self._on_ack, Kind.STOPPED: self._on_stopped,
                         Kind.CANCEL: self._on_cancel, Kind.ERROR: self._on_error,
                         Kind.PING: lambda conn, m: None}  # any valid frame counts as alive
        self.start()
        self.call_sync(lambda: None, timeout=30.0)

    def on_start(self) -> None:
        self.plane = make_plane(self.config, self.pool, self.name, exporter=True)
        self.plane.wake = self.wake
        if self.pool.is_cuda:
            self._waiter = EventWaiter(self.wake, "kv-send-events")

    def on_stop(self) -> None:
        if self._waiter is not None:
            self._waiter.close()
        super().on_stop()

    def busy(self) -> bool:
        return bool(self._queue) or super().busy()

    # ---- caller side -------------------------------------------------------------
    def connect(self, address: str, timeout: float | None = None) -> None:
        """Starts the handshake and returns at once; with ``timeout``, waits that long for
        it and raises HandshakeError / TransferError as it fails."""
        m = _ADDRESS.fullmatch(address)
        if m is None or not 0 < int(m.group(2)) < 65536:
            raise TransferError(f"connect: {address!r} is not a tcp://HOST:PORT address")
        fut: Future[None] = Future()
        self.call(lambda: self._open(address, fut))
        if timeout is None:
            return
        try:
            fut.result(timeout)
        except FutureTimeout:
            self.call(lambda: self._drop_conn(address, "connect timed out"))
            raise TransferError(f"connect {address}: no handshake reply in {timeout} s") from None

    def push(self, request_id: str, peer: str, src_block_ids: Sequence[int],
             dst_block_ids: Sequence[int], deadline: float | None = None,
             after: object | None = None) -> None:
        self.pool.check_ids(src_block_ids, "src_block_ids")
        runs = block_runs(src_block_ids, dst_block_ids)
        prev = self._mirror_new(request_id)
        if prev is not None and prev.terminal:
            raise TransferError(f"push({request_id!r}): transfer already {prev.name}")
        dl = deadline if deadline is not None else time.monotonic() + self.config.transfer_timeout_s
        self._enqueue(lambda: self._push(request_id, peer, runs, dl), after=after)

    def finish(self, request_id: str, notice: TransferNotice) -> None:
        if notice.request_id != request_id:
            raise TransferError(f"finish({request_id!r}): notice is for {notice.request_id!r}")
        self._mirror_new(request_id)
        self._enqueue(lambda: self._finish(request_id, notice), moves_bytes=False)

    def cancel(self, request_id: str, reason: str = "cancelled") -> None:
        # queued behind this request's pushes, so a push still waiting cannot outrun it
        self._enqueue(lambda: self.cancel_now(request_id, reason), moves_bytes=False)

    def accounting(self) -> Accounting:
        def count() -> Accounting:
            return Accounting(len(self.recs), self.ops_in_flight(), len(self.conns))

        return self.call_sync(count, timeout=10.0)  # type: ignore[no-any-return]

    def _enqueue(self, fn: Callable[[], None], moves_bytes: bool = True,
                 after: object | None = None) -> None:
        """Runs ``fn`` on the I/O thread after everything queued before it; a push also
        waits for the kernels that wrote its blocks: ``after``, or the caller's CUDA work
        so far."""
        event: Any = None
        if self.pool.is_cuda and moves_bytes:
            event = after
            if event is None:
                import torch

                event = torch.cuda.Event()
                event.record(torch.cuda.current_stream(self.pool.tensor.device))

        def queue() -> None:
            self._queue.append((event, fn))
            if event is not None and self._waiter is not None:
                self._waiter.add(event)  # wakes the loop the moment the bytes are written

        self.call(queue)

    # ---- loop side: connections ---------------------------------------------------
    def on_readable(self, sock: Any) -> None:
        watched = next((c for c in self.conns.values() if c.monitor is sock), None)
        if watched is not None:
            self._on_monitor(watched)
            return
        conn = next((c for c in self.conns.values() if c.sock is sock), None)
        # identity, not the address: a queued call may drop this connection and open a new
        # one to the same consumer while its last messages are handled
        while conn is not None and self.conns.get(conn.address) is conn:
            try:
                frames = sock.recv_multipart(flags=zmq.NOBLOCK)
            except zmq.Again:
                return
            self.run_calls()
            who = f"consumer {conn.address}"
            try:
                if len(frames) != 1:
                    raise MalformedMessage(f"{len(frames)} frames in one message, expected 1")
                msgs = wire.decode(frames[0], wire.TO_PRODUCER)
                if not conn.welcomed and msgs[0].KIND not in _HANDSHAKE_REPLIES:
                    raise MalformedMessage(f"{msgs[0].KIND.value} before the handshake's reply")
            except MalformedMessage as e:
                self.malformed(who, str(e))
                continue
            conn.last_heard = time.monotonic()
            self.dispatch(conn, msgs, who, _current(self.conns, conn.address, conn))

    # ---- loop side: handlers --------------------------------------------------------
    def _leg_of(self, conn: Conn, rid: str) -> tuple[SendRecord, Leg] | tuple[None, None]:
        """A consumer speaks only for the transfers on its own connection."""
        rec = self.recs.get(rid)
        leg = rec.leg_of(conn) if rec is not None else None
        return (rec, leg) if rec is not None and leg is not None else (None, None)

    def _on_ack(self, conn: Conn, m: wire.Ack) -> None:
        if (leg := self._leg_of(conn, m.rid)[1]) is not None:
            leg.acked, leg.await_peer = True, False

    def _on_stopped(self, conn: Conn, m: wire.Stopped) -> None:
        if (leg := self._leg_of(conn, m.rid)[1]) is not None:
            leg.await_peer = False  # the consumer reads no more of its blocks

    def _on_cancel(self, conn: Conn, m: wire.Cancel) -> None:
        rec, leg = self._leg_of(conn, m.rid)
        if rec is not None and leg is not None:
            leg.await_peer, leg.quiet = False, True
            self.end(rec, TransferStatus.CANCELLED, f"cancelled by consumer: {m.reason}",
                     notify=True)  # the other consumer ranks, if any, are told

    def _on_error(self, conn: Conn, m: wire.Error) -> None:
        rec, leg = self._leg_of(conn, m.rid)
        if rec is not None and leg is not None:
            leg.await_peer, leg.quiet = False, True
            self.end(rec, TransferStatus.FAILED, f"consumer refused: {m.error}", notify=True)

    # ---- loop side: records ---------------------------------------------------------
    def _record(self, rid: str, deadline: float) -> SendRecord:
        rec = self.recs.get(rid)
        if rec is None:
            rec = self.recs[rid] = SendRecord(rid, deadline)
        return rec

    def _leg(self, rec: SendRecord, address: str) -> Leg | None:
        """The record's leg to ``address`` (made on its first push), or None after ending
        the record because we are not connected there."""
        leg = rec.legs.get(address)
        if leg is None:
            conn = self.conns.get(address)
            if conn is None:
                self.end(rec, TransferStatus.FAILED,
                         f"not connected to {address}: connect() first", notify=True)
                return None
            leg = rec.legs[address] = Leg(conn)
        return leg

    def _later(self, conn: Conn, rec: SendRecord, fn: Callable[[], None]) -> None:
        """Runs ``fn`` on WELCOME, unless the record ended or was released meanwhile."""
        def run() -> None:
            if self.recs.get(rec.request_id) is rec and rec.ending is None:
                fn()

        conn.waiting.append(run)

    def _push(self, rid: str, address: str, runs: list[BlockRun], deadline: float) -> None:
        rec = self._record(rid, deadline)
        if rec.ending is not None or rec.status.terminal:
            return  # pushes after a cancel are dropped: the caller learns it from poll()
        leg = self._leg(rec, address)
        if leg is None:
            return
        conn = leg.conn
        assert self.plane is not None
        if conn.handle is None:  # still handshaking
            self._later(conn, rec, lambda: self._push(rid, address, runs, deadline))
            return
        if conn.serves is not None:
            self.end(rec, TransferStatus.FAILED, f"{rid}: {conn.serves}", notify=True)
            return
        top = max(r.dst_start + r.num_blocks for r in runs) if runs else 0
        if min((r.dst_start for r in runs), default=0) < 0 or top > conn.remote_blocks:
            self.end(rec, TransferStatus.FAILED, f"{rid}: dst block ids outside the consumer's "
                     f"pool of {conn.remote_blocks} blocks", notify=True)
            return
        wire_runs = []
        for r in runs:
            tag = conn.next_tag()
            rec.ops.append(self.plane.send(conn.handle, tag, r.src_start, r.dst_start,
                                           r.num_blocks, conn.cut))
            self.payload_bytes += self.run_nbytes(r.num_blocks, conn.cut)
            wire_runs.append(wire.WireRun(tag, r.dst_start, r.num_blocks, r.src_start))
        rec.runs += len(runs)
        leg.runs += len(runs)
        conn.outbox.append(wire.Push(rid, tuple(wire_runs)))
        if rec.status == TransferStatus.PENDING:
            self.set_status(rec, TransferStatus.IN_FLIGHT)

    def _finish(self, rid: str, notice: TransferNotice) -> None:
        rec = self.recs.get(rid)
        if rec is None:  # finish without any push: no consumer to tell
            rec = self._record(rid, time.monotonic() + self.config.transfer_timeout_s)
            self.end(rec, TransferStatus.FAILED, f"{rid}: finish without a push: not "
                     "connected to any consumer: connect() and push() first", notify=False)
        if rec.ending is not None or rec.status.terminal:
            return
        rec.notice = notice
        for leg in rec.legs.values():  # every consumer rank this request went to
            self._finish_leg(rec, leg, notice)

    def _finish_leg(self, rec: SendRecord, leg: Leg, notice: TransferNotice) -> None:
        if leg.conn.handle is None:  # behind its pushes, still waiting for WELCOME
            self._later(leg.conn, rec, lambda: self._finish_leg(rec, leg, notice))
            return
        rec.total = rec.runs
        if notice.sent_ns:  # timed: re-stamped as it goes on the wire (this turn's end), so
            # the handoff's parts split this side's queue from the wire and the consumer
            notice = replace(notice, sent_ns=time.time_ns())
        leg.conn.outbox.append(wire.Finish(rec.request_id, leg.runs, notice))

    def notify_cancel(self, rec: SendRecord, reason: str) -> None:
        assert self.plane is not None
        for leg in rec.legs.values():
            conn = leg.conn
            if leg.quiet or self.conns.get(conn.address) is not conn or conn.handle is None:
                continue
            leg.await_peer = self.plane.pull and leg.runs > 0
            conn.outbox.append(wire.Cancel(rec.request_id, reason))

    def peer_gone(self, rec: SendRecord, peer: object) -> None:
        for leg in rec.legs.values():
            if leg.conn is peer:
                leg.await_peer, leg.quiet = False, True

    def tick(self, now: float) -> None:
        assert self.plane is not None
        self.plane.progress()
        while self._queue and (self._queue[0][0] is None or self._queue[0][0].query()):
            self._queue.popleft()[1]()
        stuck: set[str] = set()
        hb = self.config.heartbeat_interval_s
        for rec in list(self.recs.values()):
            if rec.status.terminal:
                continue
            if self.step_record(rec, now):
                stuck.update(leg.conn.address for leg in rec.legs.values())
            elif rec.ending is None and rec.legs and not rec.ops \
                    and all(leg.acked for leg in rec.legs.values()):
                self.finalize(rec, TransferStatus.DONE, None)
        for conn in list(self.conns.values()):
            silent = now - conn.last_heard
            # once WELCOME came the consumer is reachable: vetting its info is our own work,
            # bounded by plane_probe's timeouts
            if not conn.welcomed and now - conn.opened > self.config.connect_timeout_s:
                self._drop_conn(conn.address, f"consumer {conn.address}: no handshake reply in "
                                f"{self.config.connect_timeout_s} s (connect_timeout_s)")
            elif conn.handle is not None and silent > self.config.peer_timeout_s:
                self._drop_conn(conn.address, f"consumer {conn.address} silent for {silent:.1f} s "
                                f"(peer_timeout_s={self.config.peer_timeout_s})")
            elif conn.address in stuck:
                self._drop_conn(conn.address, f"consumer {conn.address}: ops did not drain")
            elif conn.handle is not None and now - conn.last_ping > hb:
                conn.last_ping = now
                conn.outbox.append(wire.Ping())

    def shutdown(self) -> None:
        super().shutdown()
        self.end_turn()  # the CANCELs of open transfers go out before the sockets close
        for address in list(self.conns):
            self._drop_conn(address, f"{self.name} closed")


def _current(conns: dict[str, Conn], address: str, conn: Conn) -> Callable[[], bool]:
    return lambda: conns.get(address) is conn
