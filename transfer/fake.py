"""In-process fake of the contract: same statuses, errors and ownership, no network.

Bytes move by a synchronous tensor copy at push time, so a cancel never has anything to
drain. Receivers register in a process-wide fabric under ``fake://<name>-<n>`` addresses.
One lock guards the fabric, so any thread may call any method.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

from engine.kv_layout import KVLayout
from transfer import handshake
from transfer.base import KVReceiver, KVSender
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
    peer: _FakeSide | None = None  # the other side
    dst: frozenset[int] = frozenset()  # receiver: reserved blocks
    status: TransferStatus = S.PENDING
    runs: int = 0
    notice: TransferNotice | None = None


class _FakeSide:
    def __init__(self, tensor: object, layout: KVLayout, config: TransferConfig,
                 name: str) -> None:
        self.pool = KVPool(tensor, layout)  # type: ignore[arg-type]
        self.layout, self.config, self.name = layout, config, name
        self.recs: dict[str, _Rec] = {}
        self._updates: list[TransferUpdate] = []
        self.peers: set[_FakeSide] = set()

    def _end(self, rec: _Rec, st: TransferStatus, error: str | None) -> None:
        if not rec.status.terminal:
            rec.status = st
            notice = rec.notice if st == S.DONE else None
            self._updates.append(TransferUpdate(rec.request_id, st, notice, error))

    def _end_both(self, rec: _Rec, st: TransferStatus, error: str, peer_st: TransferStatus,
                  peer_error: str) -> None:
        self._end(rec, st, error)
        other = rec.peer
        if other is not None and rec.request_id in other.recs:
            other._end(other.recs[rec.request_id], peer_st, peer_error)

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
        return TransferStats()  # no wire: nothing from a peer can be malformed

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
               deadline: float | None = None) -> None:
        self.pool.check_ids(dst_block_ids, "dst_block_ids")
        dl = deadline if deadline is not None else time.monotonic() + self.config.transfer_timeout_s
        with _LOCK:
            if request_id in self.recs:
                raise TransferError(f"expect({request_id!r}): already expected")
            self.recs[request_id] = _Rec(request_id, dl, dst=frozenset(dst_block_ids))


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
             dst_block_ids: Sequence[int], deadline: float | None = None) -> None:
        self.pool.check_ids(src_block_ids, "src_block_ids")
        runs = block_runs(src_block_ids, dst_block_ids)
        with _LOCK:
            rec = self._record(request_id, peer, deadline)
            rx = rec.peer
            if rec.status.terminal or rx is None:
                return
            rrec = rx.recs.get(request_id)
            if rrec is None or rrec.status.terminal:
                why = "unknown request (no expect() here)" if rrec is None else "ended"
                self._end(rec, S.FAILED, f"consumer refused: {request_id}: {why}")
                return
            bad = [r for r in runs if any(b not in rrec.dst for b in
                                          range(r.dst_start, r.dst_start + r.num_blocks))]
            if bad:
                why = f"{request_id}: push to blocks {bad[0].dst_start}.. outside the reservation"
                self._end_both(rec, S.FAILED, f"consumer refused: {why}", S.FAILED, why)
                return
            for r in runs:
                self.pool.copy_run(rx.pool, r)
            rec.runs += len(runs)
            rrec.runs += len(runs)
            rec.status = rrec.status = S.IN_FLIGHT
            rrec.peer = self

    def finish(self, request_id: str, notice: TransferNotice) -> None:
        if notice.request_id != request_id:
            raise TransferError(f"finish({request_id!r}): notice is for {notice.request_id!r}")
        with _LOCK:
            rec = self.recs.get(request_id) or self._record(request_id, "", None)
            rx = rec.peer
            if rec.status.terminal or rx is None:
                return
            rrec = rx.recs.get(request_id)
            if rrec is None:
                self._end(rec, S.FAILED, f"consumer refused: {request_id}: unknown request")
                return
            rec.notice = rrec.notice = notice
            rx._end(rrec, S.DONE, None)
            self._end(rec, S.DONE, None)

    def _record(self, rid: str, address: str, deadline: float | None) -> _Rec:
        rec = self.recs.get(rid)
        if rec is None:
            dl = time.monotonic() + self.config.transfer_timeout_s if deadline is None else deadline
            rx = _FABRIC.get(address)
            rec = self.recs[rid] = _Rec(rid, dl, peer=rx if rx in self.peers else None)
            if rec.peer is None:
                self._end(rec, S.FAILED, f"not connected to {address}: connect() first")
        elif rec.status.terminal:
            raise TransferError(f"push({rid!r}): transfer already {rec.status.name}")
        return rec
