"""Producer side over the network: one ZMQ DEALER per consumer, a data plane for bytes."""

from __future__ import annotations

import collections
import random
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from typing import Any

import zmq

from engine.kv_layout import KVLayout
from transfer import handshake
from transfer.base import KVSender
from transfer.event_waiter import EventWaiter
from transfer.io_loop import pack, pack_many, unpack_many
from transfer.net_side import MAX_TAG_SEQ, NetSide, Record, make_plane
from transfer.pool import BlockRun, block_runs
from transfer.types import (
    Accounting,
    HandshakeError,
    TransferConfig,
    TransferError,
    TransferNotice,
    TransferStatus,
)


@dataclass
class _Conn:
    address: str  # the consumer's advertised control address
    sock: Any  # zmq DEALER
    session: int  # random 32 bits: the high half of every tag of this connection
    ready: Future[None]  # resolved by WELCOME / REJECT
    last_heard: float
    last_ping: float = 0.0
    handle: object | None = None  # data-plane peer, after WELCOME
    remote_blocks: int = 0  # the consumer's pool size, to refuse out-of-range dst ids
    seq: int = 0
    outbox: list[list[Any]] = field(default_factory=list)  # sent at the end of the turn

    def next_tag(self) -> int:
        self.seq += 1
        if self.seq >= MAX_TAG_SEQ:
            raise TransferError(f"{self.address}: tag space exhausted; reconnect")
        return (self.session << 32) | self.seq


class NetSender(NetSide, KVSender):
    def __init__(self, tensor: object, layout: KVLayout, config: TransferConfig,
                 name: str = "producer") -> None:
        super().__init__(tensor, layout, config, name)
        self.conns: dict[str, _Conn] = {}
        # pushes/finishes in call order; the head waits for its CUDA event, if any
        self._queue: collections.deque[tuple[Any, Callable[[], None]]] = collections.deque()
        self._waiter: EventWaiter | None = None  # CUDA pools: wakes the loop per event
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
        wait = timeout if timeout is not None else self.config.connect_timeout_s
        fut: Future[None] = self.call_sync(lambda: self._open(address), timeout=10.0)
        try:
            fut.result(wait)
        except FutureTimeout:
            self.call(lambda: self._drop_conn(address, "connect timed out"))
            raise TransferError(f"connect {address}: no handshake reply in {wait} s") from None

    def push(self, request_id: str, peer: str, src_block_ids: Sequence[int],
             dst_block_ids: Sequence[int], deadline: float | None = None) -> None:
        self.pool.check_ids(src_block_ids, "src_block_ids")
        runs = block_runs(src_block_ids, dst_block_ids)
        prev = self._mirror_new(request_id)
        if prev is not None and prev.terminal:
            raise TransferError(f"push({request_id!r}): transfer already {prev.name}")
        dl = deadline if deadline is not None else time.monotonic() + self.config.transfer_timeout_s
        self._enqueue(lambda: self._push(request_id, peer, runs, dl))

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

    def _enqueue(self, fn: Callable[[], None], moves_bytes: bool = True) -> None:
        """Runs ``fn`` on the I/O thread after everything queued before it; a push also
        waits for the caller's CUDA work so far (the kernels that wrote its blocks)."""
        event = None
        if self.pool.is_cuda and moves_bytes:
            import torch

            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(self.pool.tensor.device))

        def queue() -> None:
            self._queue.append((event, fn))
            if event is not None and self._waiter is not None:
                self._waiter.add(event)  # wakes the loop the moment the bytes are written

        self.call(queue)

    # ---- loop side ---------------------------------------------------------------
    def _open(self, address: str) -> Future[None]:
        conn = self.conns.get(address)
        if conn is not None:
            return conn.ready
        assert self.plane is not None
        sock = self.zctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(address)
        self.poller.register(sock, zmq.POLLIN)
        conn = _Conn(address, sock, random.getrandbits(32), Future(), time.monotonic())
        self.conns[address] = conn
        hello = handshake.hello(self.layout, self.config.backend, self.plane.local_info(),
                                self.config.cluster_token)
        sock.send(pack("HELLO", {**hello, "name": self.name}))
        return conn.ready

    def _record(self, rid: str, address: str, deadline: float) -> Record:
        rec = self.recs.get(rid)
        if rec is None:
            rec = self.recs[rid] = Record(rid, deadline, peer=self.conns.get(address))
            if rec.peer is None or rec.peer.handle is None:  # type: ignore[attr-defined]
                self.end(rec, TransferStatus.FAILED,
                         f"not connected to {address}: connect() first", notify=False)
        return rec

    def _push(self, rid: str, address: str, runs: list[BlockRun], deadline: float) -> None:
        rec = self._record(rid, address, deadline)
        conn = rec.peer
        if rec.ending is not None or rec.status.terminal:
            return  # pushes after a cancel are dropped: the caller learns it from poll()
        assert isinstance(conn, _Conn) and self.plane is not None
        if conn.address != address:
            self.end(rec, TransferStatus.FAILED, f"{rid}: pushed to {address} but started "
                     f"on {conn.address}", notify=True)
            return
        top = max(r.dst_start + r.num_blocks for r in runs) if runs else 0
        if min((r.dst_start for r in runs), default=0) < 0 or top > conn.remote_blocks:
            self.end(rec, TransferStatus.FAILED, f"{rid}: dst block ids outside the consumer's "
                     f"pool of {conn.remote_blocks} blocks", notify=True)
            return
        wire = []
        for r in runs:
            tag = conn.next_tag()
            rec.ops.append(self.plane.send(conn.handle, tag, r.src_start, r.dst_start,
                                           r.num_blocks))
            wire.append([tag, r.dst_start, r.num_blocks, r.src_start])
        rec.runs += len(runs)
        conn.outbox.append(["PUSH", {"rid": rid, "runs": wire}])
        if rec.status == TransferStatus.PENDING:
            self.set_status(rec, TransferStatus.IN_FLIGHT)

    def _finish(self, rid: str, notice: TransferNotice) -> None:
        rec = self.recs.get(rid)
        if rec is None:  # finish without any push: no full block to send
            rec = self._record(rid, "", time.monotonic() + self.config.transfer_timeout_s)
        if rec.ending is not None or rec.status.terminal or not isinstance(rec.peer, _Conn):
            return
        rec.total, rec.notice = rec.runs, notice
        rec.peer.outbox.append(["FINISH", {"rid": rid, "total": rec.runs,
                                           "notice": notice.to_wire()}])

    def notify_cancel(self, rec: Record, reason: str) -> None:
        if isinstance(rec.peer, _Conn) and rec.peer.address in self.conns:
            assert self.plane is not None
            rec.await_peer = self.plane.pull and rec.runs > 0
            rec.peer.outbox.append(["CANCEL", {"rid": rec.request_id, "reason": reason}])

    def end_turn(self) -> None:
        for conn in self.conns.values():
            if conn.outbox:
                msgs, conn.outbox = conn.outbox, []
                conn.sock.send(pack_many(msgs))

    def on_readable(self, sock: Any) -> None:
        conn = next((c for c in self.conns.values() if c.sock is sock), None)
        # identity, not the address: a queued call may drop this connection and open a new
        # one to the same consumer while its last messages are handled
        while conn is not None and self.conns.get(conn.address) is conn:
            try:
                msgs = unpack_many(sock.recv(flags=zmq.NOBLOCK))
            except zmq.Again:
                return
            self.run_calls()
            conn.last_heard = time.monotonic()
            for kind, body in msgs:
                if self.conns.get(conn.address) is conn:
                    self._dispatch(conn, kind, body)

    def _dispatch(self, conn: _Conn, kind: str, body: dict[str, Any]) -> None:
        rec = self.recs.get(body.get("rid", ""))
        if kind == "WELCOME":
            self._on_welcome(conn, body)
        elif kind == "REJECT":
            err = HandshakeError(f"consumer {conn.address}: {body['error']}")
            if not conn.ready.done():
                conn.ready.set_exception(err)
            self._drop_conn(conn.address, str(err))
        elif kind == "ACK" and rec is not None:
            rec.acked, rec.await_peer = True, False
        elif kind == "STOPPED" and rec is not None:
            rec.await_peer = False  # the consumer reads no more of its blocks
        elif kind == "CANCEL" and rec is not None:
            rec.await_peer = False
            self.end(rec, TransferStatus.CANCELLED,
                     f"cancelled by consumer: {body['reason']}", notify=False)
        elif kind == "ERROR" and rec is not None:
            rec.await_peer = False
            self.end(rec, TransferStatus.FAILED, f"consumer refused: {body['error']}",
                     notify=False)

    def _on_welcome(self, conn: _Conn, body: dict[str, Any]) -> None:
        assert self.plane is not None
        try:
            handshake.check(self.layout, self.config.backend, body,
                            f"consumer {conn.address}")
        except HandshakeError as e:
            conn.ready.set_exception(e)
            self._drop_conn(conn.address, str(e))
            return
        try:
            conn.handle = self.plane.add_peer(body["plane"])
        except TransferError as e:
            conn.ready.set_exception(HandshakeError(f"consumer {conn.address}: {e}"))
            self._drop_conn(conn.address, str(e))
            return
        conn.remote_blocks = int(body["layout"]["num_blocks"])
        if not conn.ready.done():
            conn.ready.set_result(None)

    def tick(self, now: float) -> None:
        assert self.plane is not None
        self.plane.progress()
        while self._queue and (self._queue[0][0] is None or self._queue[0][0].query()):
            self._queue.popleft()[1]()
        stuck = set()
        hb = self.config.heartbeat_interval_s
        for rec in list(self.recs.values()):
            if rec.status.terminal:
                continue
            if self.step_record(rec, now) and isinstance(rec.peer, _Conn):
                stuck.add(rec.peer.address)
            elif rec.ending is None and rec.acked and not rec.ops:
                self.finalize(rec, TransferStatus.DONE, None)
        for conn in list(self.conns.values()):
            silent = now - conn.last_heard
            if silent > self.config.peer_timeout_s:
                self._drop_conn(conn.address, f"consumer {conn.address} silent for {silent:.1f} s "
                                f"(peer_timeout_s={self.config.peer_timeout_s})")
            elif conn.address in stuck:
                self._drop_conn(conn.address, f"consumer {conn.address}: ops did not drain")
            elif conn.handle is not None and now - conn.last_ping > hb:
                conn.last_ping = now
                conn.outbox.append(["PING", {}])

    def _drop_conn(self, address: str, reason: str) -> None:
        conn = self.conns.pop(address, None)
        if conn is None:
            return
        if not conn.ready.done():
            conn.ready.set_exception(TransferError(reason))
        if conn.handle is not None:
            assert self.plane is not None
            self.plane.remove_peer(conn.handle)  # cancels sends still posted to it
        self.poller.unregister(conn.sock)
        conn.sock.close(0)
        self.fail_peer_records(conn, reason)

    def shutdown(self) -> None:
        super().shutdown()
        self.end_turn()  # the CANCELs of open transfers go out before the sockets close
        for address in list(self.conns):
            self._drop_conn(address, f"{self.name} closed")
