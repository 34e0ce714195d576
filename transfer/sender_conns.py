"""The producer's connections to consumers: open (HELLO), handshake replies (WELCOME,
REJECT, a failed CURVE handshake), the outbox flush, and drop. Split from net_sender.py,
which moves the bytes: everything here is about whether a consumer may be sent to.

A connection is usable once WELCOME came and its data-plane info was vetted (off the loop,
transfer/plane_probe.py); pushes and finishes made before that wait on ``conn.waiting`` and
go out in order on WELCOME, or fail with the connection.
"""

from __future__ import annotations

import random
import time
from concurrent.futures import Future

import zmq

from engine.kv_layout import KVLayout
from transfer import curve, handshake, wire
from transfer.head_cut import cut_between
from transfer.net_side import NetSide
from transfer.records import Conn, SendRecord
from transfer.types import HandshakeError, TransferConfig, TransferError
from transfer.wire import MalformedMessage


class SenderConnections(NetSide[SendRecord]):
    def __init__(self, tensor: object, layout: KVLayout, config: TransferConfig,
                 name: str) -> None:
        super().__init__(tensor, layout, config, name)
        self.conns: dict[str, Conn] = {}

    def _open(self, address: str, outer: Future[None]) -> None:
        conn = self.conns.get(address)
        if conn is None:
            assert self.plane is not None
            sock = self.control_socket(zmq.DEALER)
            # the monitor before the connect: ZMQ does not retry a handshake that failed on a
            # protocol error (CURVE on one side only), so an event it raised before the
            # monitor was attached would be lost and connect() would only time out
            monitor = self.watch_handshakes(sock)
            sock.connect(address)
            self.poller.register(sock, zmq.POLLIN)
            now = time.monotonic()
            conn = Conn(address, sock, random.getrandbits(32), Future(), now, now)
            conn.monitor = monitor
            self.conns[address] = conn
            hello = handshake.hello(self.layout, self.config.backend, self.plane.local_info(),
                                    self.config.cluster_token)
            try:
                sock.send(wire.encode([wire.Hello(**hello, name=self.name)])[0],
                          flags=zmq.NOBLOCK)
            except zmq.Again:
                # no pipe to queue it on: the ZMQ handshake already failed (a protocol
                # error tears the pipe down and is never retried). The monitor, attached
                # before the connect, reports why; anything else ends in connect()'s
                # timeout. Raising here would kill the I/O thread over a peer's refusal.
                pass
        conn.ready.add_done_callback(lambda f: _copy_outcome(f, outer))

    def _drop_conn(self, address: str, reason: str) -> None:
        conn = self.conns.pop(address, None)
        if conn is None:
            return
        if not conn.ready.done():
            conn.ready.set_exception(TransferError(reason))
        if conn.handle is not None:
            assert self.plane is not None
            self.plane.remove_peer(conn.handle)  # cancels sends still posted to it
        self._unwatch(conn)
        self.poller.unregister(conn.sock)
        conn.sock.close(0)
        conn.waiting.clear()
        self.fail_peer_records(conn, reason)

    def end_turn(self) -> None:
        for conn in list(self.conns.values()):
            if conn.outbox:
                msgs, conn.outbox = conn.outbox, []
                try:
                    for frame in wire.encode(msgs):
                        conn.sock.send(frame, flags=zmq.NOBLOCK)
                except zmq.Again:  # never block the loop on a consumer that stopped reading
                    # (or is gone: with its connection down, ZMQ has nowhere to queue)
                    self._drop_conn(conn.address, f"consumer {conn.address}: send queue full "
                                    "(it stopped reading, or its connection is gone)")

    def _unwatch(self, conn: Conn) -> None:
        if conn.monitor is not None:
            self.unwatch(conn.sock, conn.monitor)
            conn.monitor = None

    def _on_monitor(self, conn: Conn) -> None:
        if (events := self.failed_handshakes(conn.monitor)) and conn.handle is None:
            err = HandshakeError(f"consumer {conn.address}: ZMQ handshake failed: "
                                 f"{curve.handshake_failure(events)}")
            self._refused(conn, err)

    def _on_welcome(self, conn: Conn, m: wire.Hello) -> None:
        if conn.welcomed:
            raise MalformedMessage("WELCOME on a connection already welcomed")
        conn.welcomed = True
        try:
            other = handshake.check(self.layout, self.config.backend, m.remote(),
                                    f"consumer {conn.address}")
        except HandshakeError as e:
            self._refused(conn, e)
            return
        cut = cut_between(self.layout, other)
        conn.cut = None if cut is None or cut.whole else cut
        if cut is None:
            conn.serves = (f"consumer {conn.address} is rank {other.tp_rank} of tp_size "
                           f"{other.tp_size}: this producer rank {self.layout.tp_rank} of "
                           f"tp_size {self.layout.tp_size} sends it no heads (tp_plan)")
        self.vet_then(m.plane, lambda err: self._welcomed(conn, m, err))

    def _welcomed(self, conn: Conn, m: wire.Hello, vetted: str | None) -> None:
        if self.conns.get(conn.address) is not conn:
            return  # dropped while its info was vetted
        assert self.plane is not None
        try:
            if vetted is not None:
                raise TransferError(vetted)
            conn.handle = self.plane.add_peer(m.plane)
        except Exception as e:  # the reply is the peer's bytes: anything may be wrong
            self._refused(conn, HandshakeError(f"consumer {conn.address}: data-plane info: {e}"))
            return
        conn.remote_blocks = m.num_blocks
        self._unwatch(conn)  # the ZMQ handshake is long done
        if not conn.ready.done():
            conn.ready.set_result(None)
        waiting, conn.waiting = conn.waiting, []
        for fn in waiting:  # pushes and finishes made while the handshake ran, in order
            fn()

    def _refused(self, conn: Conn, err: HandshakeError) -> None:
        if not conn.ready.done():
            conn.ready.set_exception(err)
        self._drop_conn(conn.address, str(err))

    def _on_reject(self, conn: Conn, m: wire.Reject) -> None:
        self._refused(conn, HandshakeError(f"consumer {conn.address}: {m.error}"))


def _copy_outcome(src: Future[None], dst: Future[None]) -> None:
    if dst.done():
        return
    e = src.exception()
    if e is None:
        dst.set_result(None)
    else:
        dst.set_exception(e)
