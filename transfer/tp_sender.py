"""The producer's sender across its TP ranks (and across a consumer's ranks).

Rank 0 decides every push; each producer rank moves only its own heads, to the consumer
ranks ``transfer.tp_plan.parts_from`` names: rank 0 through its local sender, followers
through their rank sides (transfer.tp_rank_side), the messages queued behind the step plan
that filled the blocks. A one-rank producer uses the same path with no followers, which is
also what splits a TP consumer's comma-joined address (transfer.tp_endpoints).
"""

from __future__ import annotations

from collections.abc import Sequence

from engine.kv_layout import KVLayout
from transfer.base import KVSender
from transfer.tp_endpoints import RankChannel, TPEndpoints, attach_ranks, split_addresses
from transfer.tp_messages import FinishCmd, PushCmd
from transfer.tp_plan import parts_from
from transfer.types import TransferConfig, TransferNotice


def tp_sender(local: KVSender, layout: KVLayout, cfg: TransferConfig,
              followers: RankChannel | None, name: str = "producer") -> KVSender:
    """The worker's sender: ``local`` (rank 0's, on its pool shard) plus an endpoint on
    every follower rank (started here), acting as one. Closes ``local`` if that fails."""
    try:
        if followers is not None:
            attach_ranks(followers, "producer", layout, cfg, name)
    except BaseException:
        local.close()
        raise
    return TPSender(local, layout, followers)


class TPSender(TPEndpoints, KVSender):
    def __init__(self, local: KVSender, layout: KVLayout,
                 followers: RankChannel | None) -> None:
        super().__init__(local, followers)
        self.sender = local
        self.tp = layout.tp_size
        self.heads = layout.num_kv_heads

    def _targets(self, rank: int, addresses: list[str]) -> list[str]:
        """The consumer rank addresses producer ``rank`` sends its heads to."""
        return [addresses[p.dst_rank]
                for p in parts_from(rank, self.tp, len(addresses), self.heads)]

    def connect(self, address: str, timeout: float | None = None) -> None:
        """Rank 0's connections; followers connect with their first push (blocking only
        their own rank, while rank 0 handshakes here)."""
        for a in self._targets(0, split_addresses(address)):
            self.sender.connect(a, timeout)

    def push(self, request_id: str, peer: str, src_block_ids: Sequence[int],
             dst_block_ids: Sequence[int], deadline: float | None = None) -> None:
        addresses = split_addresses(peer)
        rec = self.recs.get(request_id)
        new = rec is None
        if rec is None:
            ranks = {r for r in range(self.tp) if self._targets(r, addresses)}
            rec = self._begin(request_id, ranks)
        try:
            if 0 in rec.ranks:
                for a in self._targets(0, addresses):
                    self.sender.push(request_id, a, src_block_ids, dst_block_ids, deadline)
        except BaseException:
            if new:  # nothing else went out: no record anywhere
                del self.recs[request_id]
            raise
        for r in sorted(rec.ranks - {0}):
            self._side(r, PushCmd(request_id, tuple(self._targets(r, addresses)),
                                  tuple(src_block_ids), tuple(dst_block_ids), deadline))

    def finish(self, request_id: str, notice: TransferNotice) -> None:
        rec = self.recs[request_id]
        for r in sorted(rec.ranks):
            if r == 0:
                self.sender.finish(request_id, notice)
            else:
                self._side(r, FinishCmd(request_id, notice))
