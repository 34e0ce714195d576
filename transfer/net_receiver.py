"""Consumer side over the network: a ZMQ ROUTER for control, a data plane for bytes.

Control messages (msgpack [kind, body]) from producers: HELLO, PUSH, FINISH, CANCEL, PING;
to producers: WELCOME / REJECT, ACK, CANCEL, ERROR, PING.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import zmq

from engine.kv_layout import KVLayout
from transfer import handshake
from transfer.base import KVReceiver
from transfer.io_loop import pack_many, unpack_many
from transfer.net_side import NetSide, Record, make_plane
from transfer.types import (
    Accounting,
    HandshakeError,
    TransferConfig,
    TransferError,
    TransferNotice,
    TransferStatus,
)


@dataclass
class _Peer:
    ident: bytes  # the producer's ZMQ identity on our ROUTER
    name: str  # the producer's self-given name, for errors
    handle: object  # data-plane peer
    last_heard: float
    last_ping: float = 0.0
    drains: list[object] = field(default_factory=list)  # receives of unwanted runs


class NetReceiver(NetSide, KVReceiver):
    def __init__(self, tensor: object, layout: KVLayout, config: TransferConfig,
                 name: str = "consumer") -> None:
        super().__init__(tensor, layout, config, name)
        self.peers: dict[bytes, _Peer] = {}
        self.dst: dict[str, frozenset[int]] = {}  # each record's reserved blocks
        self._address = ""
        self._outbox: dict[bytes, list[list[Any]]] = {}  # per producer, sent at end of turn
        self.start()
        self.call_sync(lambda: None, timeout=30.0)  # on_start done (or raised)

    @property
    def address(self) -> str:
        return self._address

    def on_start(self) -> None:
        self.plane = make_plane(self.config, self.pool, self.name, exporter=False)
        self.plane.wake = self.wake
        self.sock = self.zctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        host = self.config.host
        port = self.config.port or self.sock.bind_to_random_port(f"tcp://{host}")
        if self.config.port:
            self.sock.bind(f"tcp://{host}:{port}")
        self._address = f"tcp://{host}:{port}"
        self.poller.register(self.sock, zmq.POLLIN)

    # ---- caller side -------------------------------------------------------------
    def expect(self, request_id: str, dst_block_ids: Sequence[int],
               deadline: float | None = None) -> None:
        self.pool.check_ids(dst_block_ids, "dst_block_ids")
        if self._mirror_new(request_id) is not None:
            raise TransferError(f"expect({request_id!r}): already expected")
        dl = deadline if deadline is not None else time.monotonic() + self.config.transfer_timeout_s
        dst = frozenset(dst_block_ids)

        def run() -> None:
            self.recs[request_id] = Record(request_id, dl)
            self.dst[request_id] = dst

        self.call(run)

    def accounting(self) -> Accounting:
        def count() -> Accounting:
            drains = sum(len(p.drains) for p in self.peers.values())
            return Accounting(len(self.recs), self.ops_in_flight() + drains, len(self.peers))

        return self.call_sync(count, timeout=10.0)  # type: ignore[no-any-return]

    # ---- loop side ---------------------------------------------------------------
    def _send(self, ident: bytes, kind: str, body: dict[str, Any]) -> None:
        self._outbox.setdefault(ident, []).append([kind, body])  # sent at the end of the turn

    def end_turn(self) -> None:
        assert self.plane is not None
        self.plane.flush()  # the turn's pulls go out together, behind one event
        outbox, self._outbox = self._outbox, {}
        for ident, msgs in outbox.items():
            self.sock.send_multipart([ident, pack_many(msgs)], flags=zmq.NOBLOCK)

    def notify_cancel(self, rec: Record, reason: str) -> None:
        if isinstance(rec.peer, _Peer) and rec.peer.ident in self.peers:
            self._send(rec.peer.ident, "CANCEL", {"rid": rec.request_id, "reason": reason})

    def counts_landing(self) -> bool:
        return True

    def on_readable(self, sock: Any) -> None:
        while True:
            try:
                ident, data = self.sock.recv_multipart(flags=zmq.NOBLOCK)
            except zmq.Again:
                return
            self.run_calls()
            for kind, body in unpack_many(data):
                self._dispatch(ident, kind, body)

    def _dispatch(self, ident: bytes, kind: str, body: dict[str, Any]) -> None:
        peer = self.peers.get(ident)
        if kind == "HELLO":
            self._on_hello(ident, body)
        elif peer is None:
            self._send(ident, "REJECT", {"error": f"{self.name}: not connected, handshake "
                                                  "first (consumer restarted?)"})
        else:
            peer.last_heard = time.monotonic()
            getattr(self, f"_on_{kind.lower()}", lambda p, b: None)(peer, body)

    def _on_hello(self, ident: bytes, body: dict[str, Any]) -> None:
        who = f"producer {body.get('name')!r}"
        try:
            handshake.check(self.layout, self.config.backend, body, who)
            handshake.check_token(self.config.cluster_token, body, who)
        except HandshakeError as e:
            self._send(ident, "REJECT", {"error": str(e)})
            return
        if ident in self.peers:  # a re-handshake replaces the old session
            self._drop_peer(self.peers[ident], f"{who} reconnected")
        assert self.plane is not None
        try:
            handle = self.plane.add_peer(body["plane"])
        except TransferError as e:
            self._send(ident, "REJECT", {"error": f"{self.name}: {e}"})
            return
        self.peers[ident] = _Peer(ident, str(body.get("name")), handle, time.monotonic())
        reply = handshake.hello(self.layout, self.config.backend, self.plane.local_info())
        self._send(ident, "WELCOME", {**reply, "name": self.name})

    def _on_push(self, peer: _Peer, body: dict[str, Any]) -> None:
        assert self.plane is not None
        rid = body["rid"]
        rec = self.recs.get(rid)
        wanted = (rec is not None and rec.ending is None and not rec.status.terminal
                  and (rec.peer is None or rec.peer is peer))
        error = None if rec is not None else f"{rid}: unknown request (no expect() here)"
        for tag, dst, n, src in body["runs"]:  # src: where the run starts at the producer
            take = wanted and error is None
            if take and not self.dst[rid].issuperset(range(dst, dst + n)):
                error = f"{rid}: push to blocks {dst}..{dst + n - 1} outside the reservation"
                take = False
            if take:
                assert rec is not None
                try:
                    rec.ops.append(self.plane.recv(peer.handle, tag, dst, n, src))
                    continue
                except TransferError as e:
                    error = f"{rid}: {e}"
            # the sender's message is in flight: drain it so neither side hangs
            peer.drains.append(self.plane.recv(peer.handle, tag, None, n, src))
        if rec is not None and wanted:
            rec.peer = peer
            if error is not None:
                self.end(rec, TransferStatus.FAILED, error, notify=False)
            elif rec.status == TransferStatus.PENDING:
                self.set_status(rec, TransferStatus.IN_FLIGHT)
        if error is not None:
            self._send(peer.ident, "ERROR", {"rid": rid, "error": error})

    def _on_finish(self, peer: _Peer, body: dict[str, Any]) -> None:
        rec = self.recs.get(body["rid"])
        if rec is None:
            self._send(peer.ident, "ERROR", {"rid": body["rid"],
                                             "error": f"{body['rid']}: unknown request"})
        elif rec.ending is None and not rec.status.terminal:
            rec.peer, rec.total = peer, body["total"]
            rec.notice = TransferNotice.from_wire(body["notice"])

    def _on_cancel(self, peer: _Peer, body: dict[str, Any]) -> None:
        rec = self.recs.get(body["rid"])
        if rec is not None and rec.peer in (None, peer) and not rec.status.terminal:
            rec.stop_to = peer  # answered with STOPPED once our reads of its blocks drained
            self.end(rec, TransferStatus.CANCELLED, f"cancelled by producer: {body['reason']}",
                     notify=False)
        else:  # nothing of ours reads its blocks
            self._send(peer.ident, "STOPPED", {"rid": body["rid"]})

    def finalize(self, rec: Record, st: TransferStatus, error: str | None) -> None:
        super().finalize(rec, st, error)
        stop_to = rec.stop_to
        if isinstance(stop_to, _Peer) and stop_to.ident in self.peers:
            rec.stop_to = None
            self._send(stop_to.ident, "STOPPED", {"rid": rec.request_id})

    def tick(self, now: float) -> None:
        assert self.plane is not None
        self.plane.progress()
        stuck: set[int] = set()
        for rec in list(self.recs.values()):
            if rec.status.terminal:
                continue
            if self.step_record(rec, now) and isinstance(rec.peer, _Peer):
                stuck.add(id(rec.peer))
            elif (rec.ending is None and rec.total is not None and rec.runs == rec.total
                  and not rec.ops):
                self.finalize(rec, TransferStatus.DONE, None)
                assert isinstance(rec.peer, _Peer)
                self._send(rec.peer.ident, "ACK", {"rid": rec.request_id})
        for peer in list(self.peers.values()):
            peer.drains = [op for op in peer.drains if not _done_quietly(self.plane, op)]
            silent = now - peer.last_heard
            if silent > self.config.peer_timeout_s:
                self._drop_peer(peer, f"producer {peer.name!r} silent for {silent:.1f} s "
                                      f"(peer_timeout_s={self.config.peer_timeout_s})")
            elif id(peer) in stuck:
                self._drop_peer(peer, f"producer {peer.name!r}: operations did not drain")
            elif now - peer.last_ping > self.config.heartbeat_interval_s:
                peer.last_ping = now
                self._send(peer.ident, "PING", {})

    def _drop_peer(self, peer: _Peer, reason: str) -> None:
        assert self.plane is not None
        self.peers.pop(peer.ident, None)
        self.plane.remove_peer(peer.handle)  # cancels every receive posted for it
        peer.drains.clear()
        self.fail_peer_records(peer, reason)

    def _forget(self, request_id: str) -> None:
        super()._forget(request_id)
        self.dst.pop(request_id, None)

    def shutdown(self) -> None:
        super().shutdown()
        self.end_turn()  # the CANCELs of open transfers go out before the peers go
        for peer in list(self.peers.values()):
            self._drop_peer(peer, f"{self.name} closed")


def _done_quietly(plane: Any, op: object) -> bool:
    try:
        return bool(plane.test(op))
    except TransferError:
        return True  # a drained run's error concerns nobody
