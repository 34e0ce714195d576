"""Rank 0's view of a TP worker's KV transfer endpoints: one per rank, each on its own pool
shard, acting as one sender (producer) or one receiver (consumer).

Lifecycle of one request's record (rank 0 owns it):
  begin (first push / expect; the ranks that hold a part, per transfer.tp_plan) -->
  each rank reports its own terminal update (rank 0 from its local endpoint, followers over
  the side channel) --> the first rank that ends other than DONE cancels the others -->
  once EVERY involved rank is terminal, poll() reports one combined update (DONE only if
  all were DONE) --> release() forgets it on every rank.
So blocks stay pinned (producer) or reserved (consumer) until no rank reads or writes them.
A follower that dies never reports: ``TPFollowers.reports`` raises TPRankError instead, and
the engine process fails as a whole (the worker's requests end with its error).
Messages to and from the followers' endpoints (``transfer.tp_rank_side``) are
``transfer.tp_messages``, carried by the engine's rank channel (``RankChannel``).

A consumer with several ranks advertises every rank's address, comma-joined in rank order
(``join_addresses``): the producer splits it and each producer rank pushes to the consumer
ranks that take its heads. A one-rank consumer's address is a plain address, as before.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from engine.kv_layout import KVLayout
from transfer.base import KVReceiver, KVSender
from transfer.tp_messages import (
    FROM_RANK,
    TO_RANK,
    CancelCmd,
    FromRank,
    RankSideArgs,
    RankSideInfo,
    ReleaseCmd,
    StatsReport,
    ToRank,
    UpdateReport,
)
from transfer.tp_rank_side import FACTORY
from transfer.types import (
    Accounting,
    TransferConfig,
    TransferStats,
    TransferStatus,
    TransferUpdate,
)

SEP = ","


def split_addresses(address: str) -> list[str]:
    """A consumer's advertised KV address -> one address per consumer rank."""
    parts = [a.strip() for a in address.split(SEP)]
    if not parts or any(not a for a in parts):
        raise ValueError(f"kv_address: empty rank address in {address!r}")
    return parts


def join_addresses(addresses: list[str]) -> str:
    return SEP.join(addresses)


class RankChannel(Protocol):
    """What the TP composites need of the engine's follower ranks (``TPFollowers``): start a
    rank side on each, send one a message behind the step plans, read their reports."""

    def attach(self, factory: str, args: bytes, timeout_s: float = 60.0) -> list[bytes]: ...

    def side(self, rank: int, msg: bytes) -> None: ...

    def reports(self) -> list[tuple[int, bytes]]: ...

    def copy_blocks(self, ranks: Sequence[int], block_ids: Sequence[int]) -> None:
        """Copies KV blocks from rank ``ranks[0]`` of an attention group to its other
        ``ranks`` (a replicated latent received once), behind the step plans sent so far."""


def attach_ranks(followers: RankChannel, kind: str, layout: KVLayout, cfg: TransferConfig,
                 name: str) -> list[RankSideInfo]:
    """Starts the endpoint of every follower rank; returns their infos (ranks 1..N-1).
    A fixed KV port (multi-node firewalls) gives rank r port + r."""
    # one message for all ranks: each picks port + rank in its own TransferConfig
    args = RankSideArgs(kind, name, layout, dataclasses.replace(cfg, port=0), cfg.port)
    infos = []
    for rank, body in enumerate(followers.attach(FACTORY, TO_RANK.encode(args)), 1):
        info = FROM_RANK.decode(body)
        if not isinstance(info, RankSideInfo):
            raise ValueError(f"rank {rank}: expected {RankSideInfo.KIND!r}, got {info.KIND!r}")
        infos.append(info)
    return infos


@dataclass
class _Rec:
    ranks: frozenset[int]  # ranks holding a part of this request
    got: dict[int, TransferUpdate] = field(default_factory=dict)  # first terminal per rank
    first_bad: TransferUpdate | None = None  # the first rank's non-DONE end, with its rank
    combined: TransferUpdate | None = None  # reported by poll(); release() may follow


def _all_done(first: TransferUpdate, every: Iterable[TransferUpdate]) -> TransferUpdate:
    """The DONE of a request whose every rank is DONE: the first rank's, with the handoff's
    stamps of the rank that got there last (the KV is whole only then)."""
    us = list(every)
    return dataclasses.replace(
        first, notice=None if first.notice is None else first.notice.sent_last(
            u.notice for u in us),
        notice_seen_ns=max(u.notice_seen_ns for u in us),
        kv_done_ns=max(u.kv_done_ns for u in us))


class TPEndpoints:
    """What the TP sender and receiver share: records, combining, cancel and release."""

    def __init__(self, local: KVSender | KVReceiver, followers: RankChannel | None) -> None:
        self.local = local
        self.followers = followers
        self.recs: dict[str, _Rec] = {}
        self.rank_stats: dict[int, TransferStats] = {}  # each follower's last counters

    def _begin(self, rid: str, ranks: set[int]) -> _Rec:
        rec = self.recs[rid] = _Rec(frozenset(ranks))
        return rec

    def _side(self, rank: int, msg: ToRank) -> None:
        assert self.followers is not None
        self.followers.side(rank, TO_RANK.encode(msg))

    def _on_report(self, rank: int, report: FromRank) -> None:
        """A follower's report other than a terminal update."""
        if isinstance(report, StatsReport):
            self.rank_stats[rank] = TransferStats(report.malformed, report.rejected,
                                                  report.payload_bytes)

    def poll(self) -> list[TransferUpdate]:
        ends: list[TransferUpdate] = []
        feed = [(0, u) for u in self.local.poll()]
        if self.followers is not None:
            for rank, body in self.followers.reports():
                rep: FromRank = FROM_RANK.decode(body)
                if isinstance(rep, UpdateReport):
                    feed.append((rank, TransferUpdate(rep.rid, rep.status, rep.notice,
                                                      rep.error, rep.notice_seen_ns,
                                                      rep.kv_done_ns)))
                else:
                    self._on_report(rank, rep)
        for rank, u in feed:
            done = self._feed(rank, u)
            if done is not None:
                ends.append(done)
        return ends

    def _feed(self, rank: int, u: TransferUpdate) -> TransferUpdate | None:
        rec = self.recs.get(u.request_id)
        if rec is None or rank in rec.got or rec.combined is not None:
            return None
        rec.got[rank] = u
        if u.status != TransferStatus.DONE and rec.first_bad is None:
            who = f"rank {rank}: " if len(rec.ranks) > 1 else ""
            rec.first_bad = dataclasses.replace(u, error=f"{who}{u.error}")
            self._cancel_rest(u.request_id, rec, f"rank {rank} ended: {u.error}")
        if rec.got.keys() < rec.ranks:
            return None
        if rec.first_bad is not None:
            rec.combined = rec.first_bad
        else:
            rec.combined = _all_done(rec.got[min(rec.ranks)], rec.got.values())
        self._ended(u.request_id)
        return rec.combined

    def _ended(self, rid: str) -> None:
        """Hook: the combined update of rid is out."""

    def _cancel_rest(self, rid: str, rec: _Rec, reason: str) -> None:
        for r in rec.ranks - rec.got.keys():
            if r == 0:
                self.local.cancel(rid, reason)
            else:
                self._side(r, CancelCmd(rid, reason))

    def cancel(self, request_id: str, reason: str = "cancelled") -> None:
        rec = self.recs.get(request_id)
        if rec is None:
            self.local.cancel(request_id, reason)
            return
        if rec.combined is None:
            self._cancel_rest(request_id, rec, reason)

    def release(self, request_id: str) -> None:
        rec = self.recs.get(request_id)
        if rec is None:
            self.local.release(request_id)
            return
        if rec.combined is None:
            raise ValueError(f"release({request_id!r}): not every rank is terminal yet")
        del self.recs[request_id]
        for r in rec.ranks:
            if r == 0:
                self.local.release(request_id)
            else:
                self._side(r, ReleaseCmd(request_id))

    def status(self, request_id: str) -> TransferStatus:
        rec = self.recs.get(request_id)
        if rec is None:
            return self.local.status(request_id)
        if rec.combined is not None:
            return rec.combined.status
        if rec.got or 0 not in rec.ranks:  # rank 0 holds no record of another group
            return TransferStatus.IN_FLIGHT
        return self.local.status(request_id)

    def accounting(self) -> Accounting:
        acc = self.local.accounting()
        return dataclasses.replace(acc, transfers=max(acc.transfers, len(self.recs)))

    def stats(self) -> TransferStats:
        """Every rank's counters summed: each rank moves (and may be sent bad frames for)
        its own heads, so the worker's bytes are the sum over its ranks."""
        total = self.local.stats()
        for st in self.rank_stats.values():
            total = TransferStats(
                malformed_messages=total.malformed_messages + st.malformed_messages,
                rejected_handshakes=total.rejected_handshakes + st.rejected_handshakes,
                payload_bytes=total.payload_bytes + st.payload_bytes)
        return total

    def close(self) -> None:
        self.local.close()  # the followers close theirs when the engine stops them
