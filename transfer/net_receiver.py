"""Consumer side over the network: a ZMQ ROUTER for control, a data plane for bytes.

Control messages (``transfer.wire``) from producers: HELLO, PUSH, FINISH, CANCEL, PING; to
producers: WELCOME / REJECT, ACK, CANCEL, ERROR, STOPPED, PING. The port is open to anyone
who can reach it, so a connection's first frame must be a HELLO that passes the token and
layout checks before anything else it sends is decoded; every later frame is decoded and
checked field by field, and what fails is dropped and counted (``stats()``), never raised.

A consumer rank of TP b may take one request's heads from several producer ranks of TP a
(``transfer.tp_plan``, one ``RecvPart`` each): the request is DONE once every one of them
finished and all their runs landed, and is cancelled or failed as a whole.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

import zmq

from engine.kv_layout import KVLayout
from transfer import curve, handshake, tp_plan, wire
from transfer.base import KVReceiver
from transfer.head_cut import cut_between
from transfer.io_loop import IDLE_POLL_MS, MAX_IDLE_POLL_MS
from transfer.net_side import NetSide, make_plane
from transfer.records import Peer, RecvPart, RecvRecord
from transfer.types import (
    Accounting,
    HandshakeError,
    TransferConfig,
    TransferError,
    TransferStatus,
    TransferUpdate,
)
from transfer.wire import Kind, MalformedMessage


class NetReceiver(NetSide[RecvRecord], KVReceiver):
    def __init__(self, tensor: object, layout: KVLayout, config: TransferConfig,
                 name: str = "consumer") -> None:
        super().__init__(tensor, layout, config, name)
        self.peers: dict[bytes, Peer] = {}
        self._address = ""
        self._outbox: dict[bytes, list[wire.Message]] = {}  # per producer, sent at end of turn
        self._read_ns = 0  # when the frame being handled was read off the socket (Unix ns)
        self.handlers = {Kind.HELLO: self._on_rehello, Kind.PUSH: self._on_push,
                         Kind.FINISH: self._on_finish, Kind.CANCEL: self._on_cancel,
                         Kind.PING: lambda peer, m: None}  # any valid frame counts as alive
        self.start()
        self.call_sync(lambda: None, timeout=30.0)  # on_start done (or raised)

    @property
    def address(self) -> str:
        return self._address

    def on_start(self) -> None:
        self.plane = make_plane(self.config, self.pool, self.name, exporter=False)
        self.plane.wake = self.wake
        self.sock = self.control_socket(zmq.ROUTER)
        host = self.config.host
        port = self.config.port or self.sock.bind_to_random_port(f"tcp://{host}")
        if self.config.port:
            self.sock.bind(f"tcp://{host}:{port}")
        self._address = f"tcp://{host}:{port}"
        self.poller.register(self.sock, zmq.POLLIN)
        self.monitor = self.watch_handshakes(self.sock)  # counts strangers CURVE turned away

    # ---- caller side -------------------------------------------------------------
    def expect(self, request_id: str, dst_block_ids: Sequence[int],
               deadline: float | None = None, source_tp: int | None = None) -> None:
        self.pool.check_ids(dst_block_ids, "dst_block_ids")
        src_tp = self.layout.tp_size if source_tp is None else source_tp
        lay = self.layout
        latent = tp_plan.is_latent(lay)  # one producer rank sends it, named by the request
        parts = tp_plan.parts_to(lay.tp_rank, src_tp, lay.tp_size, lay.num_kv_heads, latent,
                                 tp_plan.latent_source(request_id, src_tp) if latent else 0)
        if self._mirror_new(request_id) is not None:
            raise TransferError(f"expect({request_id!r}): already expected")
        dl = deadline if deadline is not None else time.monotonic() + self.config.transfer_timeout_s
        rec = RecvRecord(request_id, dl, dst=frozenset(dst_block_ids), source_tp=src_tp,
                         sources={p.src_rank: p for p in parts})
        self.call(lambda: self.recs.__setitem__(request_id, rec))
        self._now_ready(request_id)

    def accounting(self) -> Accounting:
        def count() -> Accounting:
            drains = sum(len(p.drains) for p in self.peers.values())
            return Accounting(len(self.recs), self.ops_in_flight() + drains, len(self.peers))

        return self.call_sync(count, timeout=10.0)  # type: ignore[no-any-return]

    # ---- loop side: the socket -----------------------------------------------------
    def _send(self, ident: bytes, msg: wire.Message) -> None:
        self._outbox.setdefault(ident, []).append(msg)  # sent at the end of the turn

    def end_turn(self) -> None:
        assert self.plane is not None
        self.plane.flush()  # the turn's pulls go out together, behind one event
        outbox, self._outbox = self._outbox, {}
        for ident, msgs in outbox.items():
            for frame in wire.encode(msgs):
                self.sock.send_multipart([ident, frame], flags=zmq.NOBLOCK)

    def on_readable(self, sock: Any) -> None:
        if sock is self.monitor:
            for event in self.failed_handshakes(self.monitor):
                self.rejected("a peer", "ZMQ handshake failed: "
                              f"{curve.handshake_failure([event])}")
            return
        while True:
            try:
                frames = self.sock.recv_multipart(flags=zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            self.run_calls()
            # when the frame was read, for the handoff's timing (a FINISH's notice_seen_ns)
            self._read_ns = time.time_ns()
            ident = bytes(frames[0].bytes)
            peer = self.peers.get(ident)
            who = (f"producer {peer.name!r} at {peer.where}" if peer is not None
                   else f"unauthenticated peer at {_where(frames[-1])}")
            if len(frames) != 2:
                self.malformed(who, f"{len(frames) - 1} frames in one message, expected 1")
                continue
            data = bytes(frames[1].bytes)
            if peer is None:
                self._first_frame(ident, data, _where(frames[1]))
                continue
            try:
                msgs = wire.decode(data, wire.TO_CONSUMER)
            except MalformedMessage as e:
                self.malformed(who, str(e))
                continue
            peer.last_heard = time.monotonic()
            self.dispatch(peer, msgs, who, _current(self.peers, peer))

    def _first_frame(self, ident: bytes, data: bytes, where: str) -> None:
        """Nothing but a HELLO is decoded from a connection that has not passed one."""
        try:
            hello = wire.decode_hello(data)
        except MalformedMessage as e:
            self.malformed(f"unauthenticated peer at {where}", str(e))
            # a producer whose consumer restarted learns it at once, not by timing out
            self._send(ident, wire.Reject(f"{self.name}: not connected, handshake first "
                                          "(consumer restarted?)"))
            return
        self._on_hello(ident, hello, where)

    # ---- loop side: handlers --------------------------------------------------------
    def _on_hello(self, ident: bytes, m: wire.Hello, where: str) -> None:
        who = f"producer {m.name!r} at {where}"
        try:  # the token first: a stranger learns nothing about our layout
            handshake.check_token(self.config.cluster_token, m.remote(), who)
            other = handshake.check(self.layout, self.config.backend, m.remote(), who)
        except HandshakeError as e:
            self.rejected(who, str(e))
            self._send(ident, wire.Reject(str(e)))
            return
        if not self.vet_then(m.plane, lambda err: self._admit(ident, m, who, where, err,
                                                               other)):
            self.rejected(who, "too many handshakes at once")
            self._send(ident, wire.Reject(f"{self.name}: busy, retry"))

    def _admit(self, ident: bytes, m: wire.Hello, who: str, where: str,
               vetted: str | None, other: KVLayout) -> None:
        if ident in self.peers:  # a re-handshake replaces the old session
            self._drop_peer(self.peers[ident], f"{who} reconnected")
        assert self.plane is not None
        try:
            if vetted is not None:
                raise TransferError(vetted)
            handle = self.plane.add_peer(m.plane)
        except Exception as e:  # the plane info is the peer's bytes: anything may be wrong
            self.rejected(who, f"data-plane info: {e}")
            self._send(ident, wire.Reject(f"{self.name}: {e}"))
            return
        cut = cut_between(other, self.layout)  # None: it sends us no heads (pushes refused)
        self.peers[ident] = Peer(ident, m.name, where, handle, m.num_blocks, time.monotonic(),
                                 layout=other, cut=None if cut is None or cut.whole else cut)
        reply = handshake.hello(self.layout, self.config.backend, self.plane.local_info())
        self._send(ident, wire.Welcome(**reply, name=self.name))

    def _on_rehello(self, peer: Peer, m: wire.Hello) -> None:
        self._on_hello(peer.ident, m, peer.where)

    def _on_push(self, peer: Peer, m: wire.Push) -> None:
        assert self.plane is not None
        for r in m.runs:  # checks that need our state: the pools' bounds, tag order
            if r.dst + r.n > self.layout.num_blocks or r.src + r.n > peer.remote_blocks:
                raise MalformedMessage(f"PUSH {m.rid}: run {tuple(r)} outside the pools "
                                       f"({self.layout.num_blocks} / {peer.remote_blocks} blocks)")
            if r.tag <= peer.last_tag:
                raise MalformedMessage(f"PUSH {m.rid}: tag {r.tag:#x} not after {peer.last_tag:#x}"
                                       " (replayed?)")
            peer.last_tag = r.tag
        rec = self.recs.get(m.rid)
        part, refused = self._part_for(rec, peer, m.rid)
        wanted = rec is not None and rec.ending is None and not rec.status.terminal \
            and part is not None
        error = refused
        for tag, dst, n, src in m.runs:  # src: where the run starts at the producer
            take = wanted and error is None
            if take and rec is not None and not rec.dst.issuperset(range(dst, dst + n)):
                error = f"{m.rid}: push to blocks {dst}..{dst + n - 1} outside the reservation"
                take = False
            if take and rec is not None and part is not None:
                try:
                    rec.ops.append(self.plane.recv(peer.handle, tag, dst, n, src, peer.cut))
                    part.posted += 1
                    self.payload_bytes += self.run_nbytes(n, peer.cut)
                    continue
                except TransferError as e:
                    error = f"{m.rid}: {e}"
            # the sender's message is in flight: drain it so neither side hangs
            peer.drains.append(self.plane.recv(peer.handle, tag, None, n, src, peer.cut))
        if rec is not None and not wanted and part is not None:
            self._late(rec, part)
        if rec is not None and wanted and part is not None:
            if error is not None:
                part.quiet = True  # told by the ERROR below; the other ranks by CANCEL
                self.end(rec, TransferStatus.FAILED, error, notify=True)
            elif rec.status == TransferStatus.PENDING:
                self.set_status(rec, TransferStatus.IN_FLIGHT)
        if error is not None:
            self._send(peer.ident, wire.Error(m.rid, error))

    def _part_for(self, rec: RecvRecord | None, peer: Peer,
                  rid: str) -> tuple[RecvPart | None, str | None]:
        """``peer``'s part of ``rec`` (made on its first message), or why it has none. A
        refused peer never ends the record: only the producer ranks it expects can."""
        if rec is None:
            return None, f"{rid}: unknown request (no expect() here)"
        part = rec.part_of(peer)
        if part is not None:
            return part, None
        other = peer.layout
        assert other is not None
        if other.tp_size != rec.source_tp:
            return None, (f"{rid}: producer is tp_size {other.tp_size}, this request "
                          f"expects tp_size {rec.source_tp} (expect(source_tp=...))")
        if other.tp_rank not in rec.sources:
            return None, (f"{rid}: producer rank {other.tp_rank} of tp_size {other.tp_size} "
                          f"sends none of this consumer rank's heads (tp_plan: ranks "
                          f"{sorted(rec.sources)})")
        if other.tp_rank in rec.parts:
            return None, None  # another session of that rank owns it: drained quietly
        part = rec.parts[other.tp_rank] = RecvPart(peer)
        return part, None

    def _on_finish(self, peer: Peer, m: wire.Finish) -> None:
        rec = self.recs.get(m.rid)
        part, refused = self._part_for(rec, peer, m.rid)
        if rec is None or part is None:
            self._send(peer.ident, wire.Error(m.rid, refused or f"{m.rid}: unknown request"))
        elif rec.ending is not None or rec.status.terminal:
            self._late(rec, part)
        else:
            if not part.posted <= m.total <= len(rec.dst):  # each run fills >= 1 block
                error = (f"{m.rid}: FINISH says {m.total} runs; {part.posted} arrived, "
                         f"{len(rec.dst)} blocks reserved")
                part.quiet = True
                self.end(rec, TransferStatus.FAILED, error, notify=True)
                self._send(peer.ident, wire.Error(m.rid, error))
                return
            part.total, part.notice, part.seen_ns = m.total, m.notice, self._read_ns

    def _on_cancel(self, peer: Peer, m: wire.Cancel) -> None:
        rec = self.recs.get(m.rid)
        part = self._part_for(rec, peer, m.rid)[0]
        if rec is not None and part is not None and not rec.status.terminal:
            part.quiet = True
            rec.stop_to.append(peer)  # answered with STOPPED once our reads drained
            self.end(rec, TransferStatus.CANCELLED, f"cancelled by producer: {m.reason}",
                     notify=True)  # the other producer ranks, if any, are told
        else:  # nothing of ours reads its blocks
            self._send(peer.ident, wire.Stopped(m.rid))

    def _late(self, rec: RecvRecord, part: RecvPart) -> None:
        """A producer rank heard from only after the request ended here (its first push was
        still on the way when we cancelled): it gets the CANCEL the others got."""
        if not part.quiet and rec.status != TransferStatus.DONE:
            part.quiet = True
            reason = rec.ending[1] if rec.ending else rec.status.name.lower()
            self._send(part.peer.ident, wire.Cancel(rec.request_id, reason))

    def _complete(self, rec: RecvRecord) -> None:
        """DONE once every producer rank finished and all its runs landed."""
        parts = rec.parts
        if rec.ending is not None or rec.ops or parts.keys() != rec.sources.keys():
            return
        totals = [p.total for p in parts.values()]
        if any(t is None for t in totals) or rec.runs != sum(t or 0 for t in totals):
            return
        notices = {p.notice for p in parts.values()}
        if len(notices) > 1:  # the ranks sampled token 0 differently: nothing to trust
            self.end(rec, TransferStatus.FAILED, f"{rec.request_id}: producer ranks sent "
                     f"different notices (token 0): {sorted(map(str, notices))[:2]}",
                     notify=True)
            return
        # the handoff's stamps: the notice that left last and the FINISH read last (with
        # several producer ranks the KV is whole only once every one of them sent its part)
        first = parts[min(parts)].notice
        assert first is not None  # set with its part's total, by its FINISH
        rec.total = rec.runs
        rec.notice = first.sent_last(p.notice for p in parts.values())
        rec.notice_seen_ns = max(p.seen_ns for p in parts.values())
        self.finalize(rec, TransferStatus.DONE, None)
        for p in parts.values():
            self._send(p.peer.ident, wire.Ack(rec.request_id))

    # ---- loop side: records and peers ----------------------------------------------
    def notify_cancel(self, rec: RecvRecord, reason: str) -> None:
        for p in rec.parts.values():
            if not p.quiet and self.peers.get(p.peer.ident) is p.peer:
                p.quiet = True
                self._send(p.peer.ident, wire.Cancel(rec.request_id, reason))

    def peer_gone(self, rec: RecvRecord, peer: object) -> None:
        for p in rec.parts.values():
            if p.peer is peer:
                p.quiet = True

    def counts_landing(self) -> bool:
        return True

    def outcome(self, rec: RecvRecord, st: TransferStatus,
                error: str | None) -> TransferUpdate:
        u = super().outcome(rec, st, error)
        if st != TransferStatus.DONE:
            return u
        # DONE becomes pollable right now: every run landed and the notice is here
        return replace(u, notice_seen_ns=rec.notice_seen_ns, kv_done_ns=time.time_ns())

    def finalize(self, rec: RecvRecord, st: TransferStatus, error: str | None) -> None:
        super().finalize(rec, st, error)
        stop_to, rec.stop_to = rec.stop_to, []
        for peer in stop_to:
            if self.peers.get(peer.ident) is peer:
                self._send(peer.ident, wire.Stopped(rec.request_id))

    def tick(self, now: float) -> None:
        assert self.plane is not None
        self.plane.progress()
        stuck: set[int] = set()
        for rec in list(self.recs.values()):
            if rec.status.terminal:
                continue
            if self.step_record(rec, now):
                stuck.update(id(p) for p in rec.peers())
            else:
                self._complete(rec)
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
                self._send(peer.ident, wire.Ping())

    def idle_poll_ms(self, now: float) -> int:
        """Open records (deadlines, endings) and draining runs keep the usual period; with
        none, the next heartbeat or silence verdict is the only timer."""
        if self.peers and any(p.drains for p in self.peers.values()) \
                or any(not r.status.terminal for r in self.recs.values()):
            return IDLE_POLL_MS
        due = [min(p.last_ping + self.config.heartbeat_interval_s,
                   p.last_heard + self.config.peer_timeout_s) for p in self.peers.values()]
        if not due:
            return MAX_IDLE_POLL_MS
        # +1: tick acts once a timer has strictly passed
        return max(1, min(MAX_IDLE_POLL_MS, int((min(due) - now) * 1e3) + 1))

    def _drop_peer(self, peer: Peer, reason: str) -> None:
        assert self.plane is not None
        self.peers.pop(peer.ident, None)
        self.plane.remove_peer(peer.handle)  # cancels every receive posted for it
        peer.drains.clear()
        self.fail_peer_records(peer, reason)

    def shutdown(self) -> None:
        super().shutdown()
        self.end_turn()  # the CANCELs of open transfers go out before the peers go
        for peer in list(self.peers.values()):
            self._drop_peer(peer, f"{self.name} closed")


def _current(peers: dict[bytes, Peer], peer: Peer) -> Callable[[], bool]:
    return lambda: peers.get(peer.ident) is peer


def _where(frame: Any) -> str:
    try:  # libzmq's per-message metadata: the peer's IP, for log lines
        return str(frame.get("Peer-Address"))
    except Exception:
        return "unknown address"


def _done_quietly(plane: Any, op: object) -> bool:
    try:
        return bool(plane.test(op))
    except TransferError:
        return True  # a drained run's error concerns nobody
