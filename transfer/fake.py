"""In-process fake of the contract: same statuses, errors and ownership, no network.

Bytes move by a synchronous tensor copy at push time, so a cancel never has anything to
drain. Receivers register in a process-wide fabric under ``fake://<name>-<n>`` addresses.
One lock guards the fabric, so any thread may call any method.

Different TP on the two sides: a sender record links to every receiver it pushed to, a
receiver record to every producer rank that pushed; the receiver is DONE once every
producer rank of its plan (``transfer.tp_plan``) finished, each sender once every
receiver it fed is, and ending one record ends every record linked to it.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from engine.kv_layout import KVLayout
from transfer import handshake, tp_plan
from transfer.base import KVReceiver, KVSender
from transfer.head_cut import cut_between
from transfer.pool import KVPool, block_runs
from transfer.types import (
    Accounting,
    TransferConfig,
    TransferError,
    TransferNotice,
    TransferStats,
    TransferStatus,
    TransferUpdate,
)

_LOCK = threading.RLock()
_FABRIC: dict[str, FakeReceiver] = {}
_IDS = itertools.count()
S = TransferStatus


@dataclass
class _Rec:
    request_id: str
    deadline: float
    dst: frozenset[int] = frozenset()  # receiver: reserved blocks
    status: TransferStatus = S.PENDING
    runs: int = 0
    notice: TransferNotice | None = None
    links: list[_FakeSide] = field(default_factory=list)  # the other side's pools in it
    source_tp: int = 1  # receiver: the producer's TP size
    sources: frozenset[int] = frozenset()  # receiver: producer ranks of the plan
    finished: dict[int, TransferNotice] = field(default_factory=dict)  # receiver: by rank
    seen_ns: int = 0  # receiver: the last producer rank's finish (Unix ns, for timing)


class _FakeSide:
    def __init__(self, tensor: object, layout: KVLayout, config: TransferConfig,
                 name: str) -> None:
        self.pool = KVPool(tensor, layout)  # type: ignore[arg-type]
        self.layout, self.config, self.name = layout, config, name
        self.recs: dict[str, _Rec] = {}
        self._updates: list[TransferUpdate] = []
        self.peers: set[_FakeSide] = set()
        self.payload_bytes = 0

    def _end(self, rec: _Rec, st: TransferStatus, error: str | None) -> None:
        if not rec.status.terminal:
            rec.status = st
            notice = rec.notice if st == S.DONE else None
            u = TransferUpdate(rec.request_id, st, notice, error)
            if st == S.DONE and rec.seen_ns:  # a receiver's: the bytes moved at push time
                u = replace(u, notice_seen_ns=rec.seen_ns, kv_done_ns=time.time_ns())
            self._updates.append(u)

    def _end_both(self, rec: _Rec, st: TransferStatus, error: str, peer_st: TransferStatus,
                  peer_error: str) -> None:
        """Ends ``rec`` and, transitively, every record linked to it (all ranks' parts)."""
        if rec.status.terminal:
            return
        self._end(rec, st, error)
        for other in rec.links:
            orec = other.recs.get(rec.request_id)
            if orec is not None:
                other._end_both(orec, peer_st, peer_error, peer_st, peer_error)

    def poll(self) -> list[TransferUpdate]:
        now = time.monotonic()
        with _LOCK:
            for side in (self, *self.peers):
                side._expire(now)
            out, self._updates = self._updates, []
        return self._take_stashed() + out  # type: ignore[attr-defined,no-any-return]

    def _expire(self, now: float) -> None:
        for rec in self.recs.values():
            if not rec.status.terminal and now > rec.deadline:
                why = f"deadline passed with {rec.runs} runs done"
                self._end_both(rec, S.TIMED_OUT, why, S.CANCELLED, f"cancelled by peer: {why}")

    def status(self, request_id: str) -> TransferStatus:
        with _LOCK:
            return self.recs[request_id].status

    def cancel(self, request_id: str, reason: str = "cancelled") -> None:
        with _LOCK:
            rec = self.recs.get(request_id)
            if rec is not None:
                self._end_both(rec, S.CANCELLED, reason, S.CANCELLED,
                               f"cancelled by {self.name}: {reason}")

    def release(self, request_id: str) -> None:
        with _LOCK:
            rec = self.recs.get(request_id)
            if rec is not None and not rec.status.terminal:
                raise ValueError(f"release({request_id!r}): status {rec.status.name} is not "
                                 "terminal; cancel() it and wait for poll() to report it")
            self.recs.pop(request_id, None)

    def accounting(self) -> Accounting:
        with _LOCK:
            return Accounting(len(self.recs), 0, len(self.peers))

    def stats(self) -> TransferStats:
        # no wire: nothing from a peer can be malformed
        return TransferStats(payload_bytes=self.payload_bytes)

    def close(self) -> None:
        with _LOCK:
            for rec in self.recs.values():
                self._end_both(rec, S.FAILED, f"{self.name} closed", S.FAILED,
                               f"peer {self.name} closed")
            for p in self.peers:
                p.peers.discard(self)
            self.peers.clear()
            _FABRIC.pop(getattr(self, "_address", ""), None)


class FakeReceiver(_FakeSide, KVReceiver):
    def __init__(self, tensor: object, layout: KVLayout, config: TransferConfig,
                 name: str = "consumer") -> None:
        super().__init__(tensor, layout, config, name)
        self._address = f"fake://{name}-{next(_IDS)}"
        with _LOCK:
            _FABRIC[self._address] = self

    @property
    def address(self) -> str:
        return self._address

    def expect(self, request_id: str, dst_block_ids: Sequence[int],
               deadline: float | None = None, source_tp: int | None = None) -> None:
        self.pool.check_ids(dst_block_ids, "dst_block_ids")
        lay = self.layout
        src_tp = lay.tp_size if source_tp is None else source_tp
        latent = tp_plan.is_latent(lay)  # one producer rank sends it, named by the request
        parts = tp_plan.parts_to(lay.tp_rank, src_tp, lay.tp_size, lay.num_kv_heads, latent,
                                 tp_plan.latent_source(request_id, src_tp) if latent else 0)
        dl = deadline if deadline is not None else time.monotonic() + self.config.transfer_timeout_s
        with _LOCK:
            if request_id in self.recs:
                raise TransferError(f"expect({request_id!r}): already expected")
            self.recs[request_id] = _Rec(request_id, dl, dst=frozenset(dst_block_ids),
                                         source_tp=src_tp,
                                         sources=frozenset(p.src_rank for p in parts))
        self._now_ready(request_id)

    def refusal(self, rrec: _Rec, sender: KVLayout) -> str | None:
        """Why the producer rank of ``sender`` may not push into ``rrec``, if so."""
        if sender.tp_size != rrec.source_tp:
            return (f"{rrec.request_id}: producer is tp_size {sender.tp_size}, this request "
                    f"expects tp_size {rrec.source_tp} (expect(source_tp=...))")
        if sender.tp_rank not in rrec.sources:
            return (f"{rrec.request_id}: producer rank {sender.tp_rank} of tp_size "
                    f"{sender.tp_size} sends none of this consumer rank's heads (tp_plan: "
                    f"ranks {sorted(rrec.sources)})")
        return None

    def land(self, rrec: _Rec, rank: int, notice: TransferNotice) -> None:
        """A producer rank finished; DONE (and its senders' DONE) once all of them did."""
        rrec.finished[rank] = notice
        rrec.seen_ns = time.time_ns()
        if set(rrec.finished) != set(rrec.sources):
            return
        if len(set(rrec.finished.values())) > 1:
            self._end_both(rrec, S.FAILED, f"{rrec.request_id}: producer ranks sent different "
                           "notices (token 0)", S.FAILED, "consumer refused: notices differ")
            return
        # as the network receiver: the notice that left last
        rrec.notice = rrec.finished[min(rrec.finished)].sent_last(rrec.finished.values())
        self._end(rrec, S.DONE, None)
        for tx in rrec.links:
            trec = tx.recs.get(rrec.request_id)
            if trec is not None and all(
                    rx.recs.get(rrec.request_id, rrec).status == S.DONE for rx in trec.links):
                tx._end(trec, S.DONE, None)


class FakeSender(_FakeSide, KVSender):
    def connect(self, address: str, timeout: float | None = None) -> None:
        with _LOCK:
            rx = _FABRIC.get(address)
            if rx is None:
                raise TransferError(f"connect {address}: no such fake receiver")
            info = handshake.hello(rx.layout, rx.config.backend, b"")
            handshake.check(self.layout, self.config.backend, info, f"consumer {address}")
            handshake.check_token(rx.config.cluster_token, handshake.hello(
                self.layout, self.config.backend, b"", self.config.cluster_token),
                f"producer -> consumer {address}")
            self.peers.add(rx)
            rx.peers.add(self)

    def push(self, request_id: str, peer: str, src_block_ids: Sequence[int],
             dst_block_ids: Sequence[int], deadline: float | None = None,
             after: object | None = None) -> None:
        self.pool.check_ids(src_block_ids, "src_block_ids")
        runs = block_runs(src_block_ids, dst_block_ids)
        with _LOCK:
            rec = self._record(request_id, peer, deadline)
            rx = _FABRIC.get(peer)
            if rec.status.terminal:
                return
            if rx is None or rx not in self.peers:
                self._end_both(rec, S.FAILED, f"not connected to {peer}: connect() first",
                               S.CANCELLED, f"cancelled by {self.name}: not connected")
                return
            rrec = rx.recs.get(request_id)
            if rrec is None or rrec.status.terminal:
                why = "unknown request (no expect() here)" if rrec is None else "ended"
                self._end_both(rec, S.FAILED, f"consumer refused: {request_id}: {why}",
                               S.CANCELLED, f"cancelled by {self.name}: {why}")
                return
            cut = cut_between(self.layout, rx.layout)
            refused = rx.refusal(rrec, self.layout) or (None if cut is not None else (
                f"{request_id}: consumer rank {rx.layout.tp_rank} takes no heads from producer "
                f"rank {self.layout.tp_rank} (tp_plan)"))
            if refused is not None:
                self._end_both(rec, S.FAILED, f"consumer refused: {refused}", S.CANCELLED,
                               f"cancelled by {self.name}: {refused}")
                return
            if rx not in rec.links:
                rec.links.append(rx)
            if self not in rrec.links:
                rrec.links.append(self)
            bad = [r for r in runs if any(b not in rrec.dst for b in
                                          range(r.dst_start, r.dst_start + r.num_blocks))]
            if bad:
                why = f"{request_id}: push to blocks {bad[0].dst_start}.. outside the reservation"
                self._end_both(rec, S.FAILED, f"consumer refused: {why}", S.FAILED, why)
                return
            cut = None if cut is None or cut.whole else cut
            for r in runs:
                self.pool.copy_run(rx.pool, r, cut)
                n = r.num_blocks * self.pool.block_nbytes if cut is None else cut.nbytes(
                    r.num_blocks)
                self.payload_bytes += n
                rx.payload_bytes += n
            rec.runs += len(runs)
            rrec.runs += len(runs)
            rec.status = rrec.status = S.IN_FLIGHT

    def finish(self, request_id: str, notice: TransferNotice) -> None:
        if notice.request_id != request_id:
            raise TransferError(f"finish({request_id!r}): notice is for {notice.request_id!r}")
        with _LOCK:
            rec = self.recs.get(request_id) or self._record(request_id, "", None)
            if rec.status.terminal:
                return
            if not rec.links:
                self._end(rec, S.FAILED, f"{request_id}: finish without a push: not connected "
                          "to any consumer: connect() and push() first")
                return
            rec.notice = notice
            for rx in list(rec.links):
                rrec = rx.recs.get(request_id)
                if rrec is None:
                    self._end_both(rec, S.FAILED, f"consumer refused: {request_id}: unknown "
                                   "request", S.CANCELLED, "cancelled: peer refused")
                    return
                if not rrec.status.terminal and isinstance(rx, FakeReceiver):
                    rx.land(rrec, self.layout.tp_rank, notice)

    def _record(self, rid: str, address: str, deadline: float | None) -> _Rec:
        rec = self.recs.get(rid)
        if rec is None:
            dl = time.monotonic() + self.config.transfer_timeout_s if deadline is None else deadline
            rec = self.recs[rid] = _Rec(rid, dl)
        elif rec.status.terminal:
            raise TransferError(f"push({rid!r}): transfer already {rec.status.name}")
        return rec
