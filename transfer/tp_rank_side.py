"""The KV transfer endpoint of one follower rank of a TP producer or consumer.

Runs in the follower's process (engine.parallel.follower imports it by name, through
``TPFollowers.attach``) over that rank's own pool shard, so every rank moves the KV of its
own heads: a producer rank pushes its heads to the consumer ranks ``transfer.tp_plan``
names, a consumer rank receives exactly its heads. Rank 0 (``transfer.tp_endpoints``)
stays the only one that decides: this side only applies its messages and reports back.
The messages are ``transfer.tp_messages``.
"""

from __future__ import annotations

import dataclasses
import logging

import torch

from engine.kv_layout import KVLayout
from transfer.base import KVReceiver, KVSender
from transfer.factory import make_receiver, make_sender
from transfer.tp_messages import (
    FROM_RANK,
    TO_RANK,
    CancelCmd,
    ExpectCmd,
    ExpectedReport,
    FinishCmd,
    FromRank,
    PushCmd,
    RankSideArgs,
    RankSideInfo,
    ReleaseCmd,
    StatsReport,
    ToRank,
    UpdateReport,
)
from transfer.types import TransferError, TransferStatus

log = logging.getLogger("pdserve.worker")
FACTORY = "transfer.tp_rank_side:make_rank_side"


class TransferRankSide:
    def __init__(self, kv_cache: torch.Tensor, rank: int, args: RankSideArgs) -> None:
        # under data-parallel attention the layout's ranks are one attention group's
        # (tp_size = T / D): engine rank r is rank r % tp_size of its group
        layout: KVLayout = dataclasses.replace(args.layout,
                                               tp_rank=rank % args.layout.tp_size)
        cfg = args.transfer
        if args.base_port:  # a fixed KV port: rank r listens on port + r
            cfg = dataclasses.replace(cfg, port=args.base_port + rank)
        self.kind = args.kind
        name = f"{args.name or self.kind}-r{rank}"
        self.side: KVSender | KVReceiver
        if self.kind == "producer":
            self.side = make_sender(kv_cache, layout, cfg, name)
        elif self.kind == "consumer":
            self.side = make_receiver(kv_cache, layout, cfg, name)
        else:
            raise ValueError(f"kind: expected 'producer' or 'consumer', got {self.kind!r}")
        self.out: list[FromRank] = []
        self.failed: set[str] = set()  # records that failed here before the side had one
        self.last_stats = (0, 0, 0)  # the counters last reported to rank 0

    def info(self) -> bytes:
        address = self.side.address if isinstance(self.side, KVReceiver) else ""
        return FROM_RANK.encode(RankSideInfo(address))

    def on_message(self, body: bytes) -> None:
        """Applies one message; a malformed one is logged (rank 0 never sends one)."""
        try:
            msg: ToRank = TO_RANK.decode(body)
        except ValueError as e:
            log.error("%s rank side: %s", self.kind, e)
            return
        self.apply(msg)

    def apply(self, msg: ToRank) -> None:
        rid = getattr(msg, "rid", "")
        try:
            self._apply(msg)
        except (TransferError, ValueError, KeyError) as e:
            if isinstance(msg, ReleaseCmd):
                return  # nothing held here for it (it failed before a record existed)
            if rid in self.failed:
                return
            try:
                self.side.status(rid)
            except KeyError:  # no record here: report the failure ourselves
                self.failed.add(rid)
                self.out.append(UpdateReport(rid, TransferStatus.FAILED, None,
                                             f"{type(e).__name__}: {e}"))
                return
            self.side.cancel(rid, str(e))  # its own terminal update follows, once drained

    def _apply(self, msg: ToRank) -> None:
        if isinstance(msg, ReleaseCmd):
            self.failed.discard(msg.rid)
            self.side.release(msg.rid)  # KeyError: no record here (failed before it had one)
            return
        if getattr(msg, "rid", "") in self.failed:
            return
        if isinstance(msg, CancelCmd):
            self.side.cancel(msg.rid, msg.reason)
        elif isinstance(msg, PushCmd) and isinstance(self.side, KVSender):
            for a in msg.addresses:
                self.side.connect(a)
                self.side.push(msg.rid, a, msg.src, msg.dst, msg.deadline)
        elif isinstance(msg, FinishCmd) and isinstance(self.side, KVSender):
            self.side.finish(msg.rid, msg.notice)
        elif isinstance(msg, ExpectCmd) and isinstance(self.side, KVReceiver):
            self.side.expect(msg.rid, msg.dst, deadline=msg.deadline, source_tp=msg.source_tp)
            self.side.take_ready()  # rank 0 announces the reservation, from every rank's word
            self.out.append(ExpectedReport(msg.rid))
        else:
            raise ValueError(f"{self.kind} rank side: unexpected {msg.KIND!r} message")

    def poll(self) -> list[bytes]:
        for u in self.side.poll():
            self.out.append(UpdateReport(u.request_id, u.status, u.notice, u.error,
                                         u.notice_seen_ns, u.kv_done_ns))
        st = self.side.stats()
        counters = (st.malformed_messages, st.rejected_handshakes, st.payload_bytes)
        if counters != self.last_stats:  # rank 0 sums every rank's counters for /metrics
            self.last_stats = counters
            self.out.append(StatsReport(*counters))
        out, self.out = self.out, []
        return [FROM_RANK.encode(m) for m in out]

    def close(self) -> None:
        self.side.close()


def make_rank_side(kv_cache: torch.Tensor, rank: int, size: int,
                   args: bytes) -> TransferRankSide:
    msg = TO_RANK.decode(args)
    if not isinstance(msg, RankSideArgs):
        raise ValueError(f"rank side: expected {RankSideArgs.KIND!r}, got {msg.KIND!r}")
    return TransferRankSide(kv_cache, rank, msg)
