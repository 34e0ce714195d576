"""The KV transfer endpoint of one follower rank of a TP producer or consumer.

Runs in the follower's process (engine.parallel.follower imports it by name, through
``TPFollowers.attach``) over that rank's own pool shard, so every rank moves the KV of its
own heads: a producer rank pushes its heads to the consumer ranks ``transfer.tp_plan``
names, a consumer rank receives exactly its heads. Rank 0 (``worker.tp_endpoints``) stays
the only one that decides: this side only applies its messages and reports back.

Messages (tuples, first item the op):
  ("push", rid, [address...], src, dst, deadline)  producer: connect + push to each
  ("finish", rid, notice) / ("cancel", rid, reason) / ("release", rid)
  ("expect", rid, dst, deadline, source_tp)        consumer; answered ("expected", rid)
Reports: ("update", rid, status, notice, error) once per terminal record;
  ("stats", malformed, rejected, payload_bytes) whenever this rank's counters changed.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import torch

from engine.kv_layout import KVLayout
from transfer import (
    KVReceiver,
    KVSender,
    TransferConfig,
    TransferError,
    TransferStatus,
    make_receiver,
    make_sender,
)

log = logging.getLogger("pdserve.worker")
FACTORY = "worker.tp_rank_side:make_rank_side"


class TransferRankSide:
    def __init__(self, kv_cache: torch.Tensor, rank: int, args: dict[str, Any]) -> None:
        layout = KVLayout(**{**args["layout"], "tp_rank": rank})
        cfg = TransferConfig(**args["transfer"])
        if args.get("base_port"):  # a fixed KV port: rank r listens on port + r
            cfg = dataclasses.replace(cfg, port=int(args["base_port"]) + rank)
        self.kind = args["kind"]
        name = f"{args.get('name', self.kind)}-r{rank}"
        self.side: KVSender | KVReceiver
        if self.kind == "producer":
            self.side = make_sender(kv_cache, layout, cfg, name)
        elif self.kind == "consumer":
            self.side = make_receiver(kv_cache, layout, cfg, name)
        else:
            raise ValueError(f"kind: expected 'producer' or 'consumer', got {self.kind!r}")
        self.out: list[Any] = []
        self.failed: set[str] = set()  # records that failed here before the side had one
        self.last_stats = (0, 0, 0)  # the counters last reported to rank 0

    def info(self) -> dict[str, Any]:
        return {"address": self.side.address if isinstance(self.side, KVReceiver) else ""}

    def on_message(self, msg: Any) -> None:
        op, rid = msg[0], msg[1]
        try:
            self._apply(op, rid, msg)
        except (TransferError, ValueError, KeyError) as e:
            if op == "release":
                return  # nothing held here for it (it failed before a record existed)
            if rid in self.failed:
                return
            try:
                self.side.status(rid)
            except KeyError:  # no record here: report the failure ourselves
                self.failed.add(rid)
                self.out.append(("update", rid, int(TransferStatus.FAILED), None,
                                 f"{type(e).__name__}: {e}"))
                return
            self.side.cancel(rid, str(e))  # its own terminal update follows, once drained

    def _apply(self, op: str, rid: str, msg: Any) -> None:
        if op == "release":
            self.failed.discard(rid)
            self.side.release(rid)  # KeyError: no record here (failed before it had one)
            return
        if rid in self.failed:
            return
        if op == "cancel":
            self.side.cancel(rid, msg[2])
        elif op == "push" and isinstance(self.side, KVSender):
            _, _, addresses, src, dst, deadline = msg
            for a in addresses:
                self.side.connect(a)
                self.side.push(rid, a, src, dst, deadline)
        elif op == "finish" and isinstance(self.side, KVSender):
            self.side.finish(rid, msg[2])
        elif op == "expect" and isinstance(self.side, KVReceiver):
            _, _, dst, deadline, source_tp = msg
            self.side.expect(rid, dst, deadline=deadline, source_tp=source_tp)
            self.out.append(("expected", rid))
        else:
            raise ValueError(f"{self.kind} rank side: unknown op {op!r}")

    def poll(self) -> list[Any]:
        for u in self.side.poll():
            self.out.append(("update", u.request_id, int(u.status), u.notice, u.error))
        st = self.side.stats()
        counters = (st.malformed_messages, st.rejected_handshakes, st.payload_bytes)
        if counters != self.last_stats:  # rank 0 sums every rank's counters for /metrics
            self.last_stats = counters
            self.out.append(("stats", *counters))
        out, self.out = self.out, []
        return out

    def close(self) -> None:
        self.side.close()


def make_rank_side(kv_cache: torch.Tensor, rank: int, size: int,
                   args: dict[str, Any]) -> TransferRankSide:
    return TransferRankSide(kv_cache, rank, args)
