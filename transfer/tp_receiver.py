"""The consumer's receiver across its TP ranks: one receiver per rank, each on its own pool
shard taking exactly its heads (transfer.tp_plan), advertised together as one
comma-joined address in rank order (transfer.tp_endpoints).

A reservation is ready to announce to the producer only once every rank has its record
(``take_ready``, the contract's): a push reaching a rank that has not processed its expect
yet would be refused as an unknown request. The KV has landed only when every rank's part
landed.

Under data-parallel attention (transfer.tp_groups) a request's blocks are reserved in its
attention group's pool, so only that group's ranks expect it, and the address a producer
is told for it (``address_for``) names those ranks alone, in rank order: a producer pairs
with them as with a consumer of the group's TP size, and no other rank hears of it.
"""

from __future__ import annotations

from collections.abc import Sequence

from engine.kv_layout import KVLayout
from transfer.base import KVReceiver
from transfer.tp_endpoints import RankChannel, TPEndpoints, attach_ranks, join_addresses
from transfer.tp_groups import GroupOf, group_ranks
from transfer.tp_messages import ExpectCmd, ExpectedReport, FromRank, RankSideInfo
from transfer.types import TransferConfig


def tp_receiver(local: KVReceiver, layout: KVLayout, cfg: TransferConfig,
                followers: RankChannel | None, name: str = "consumer",
                group_of: GroupOf | None = None) -> KVReceiver:
    """The worker's receiver: ``local`` alone on one rank; with followers, ``local`` plus an
    endpoint on every follower rank (started here), acting as one. Closes ``local`` if
    that fails. group_of: under data-parallel attention, the group holding a request's
    reserved blocks."""
    if followers is None:
        return local
    try:
        infos = attach_ranks(followers, "consumer", layout, cfg, name)
    except BaseException:
        local.close()
        raise
    return TPReceiver(local, followers, infos, layout.tp_size, group_of)


class TPReceiver(TPEndpoints, KVReceiver):
    def __init__(self, local: KVReceiver, followers: RankChannel,
                 infos: list[RankSideInfo], group_size: int = 0,
                 group_of: GroupOf | None = None) -> None:
        super().__init__(local, followers)
        self.receiver = local
        self.addresses = [local.address, *(i.address for i in infos)]  # one per rank
        self.size = len(self.addresses)
        self.group_size = group_size or self.size  # ranks per attention group
        group_ranks(0, self.group_size, self.size)  # ValueError: groups do not split ranks
        self.group_of = group_of
        self._address = join_addresses(self.addresses)
        self.unconfirmed: dict[str, set[int]] = {}  # rid -> follower ranks yet to expect it

    @property
    def address(self) -> str:
        return self._address

    def address_for(self, request_id: str) -> str:
        """The ranks of the request's attention group (every rank without DP attention)."""
        rec = self.recs.get(request_id)
        if rec is None:
            return self._address
        return join_addresses([self.addresses[r] for r in sorted(rec.ranks)])

    def expect(self, request_id: str, dst_block_ids: Sequence[int],
               deadline: float | None = None, source_tp: int | None = None) -> None:
        group = self.group_of(request_id) if self.group_of is not None else 0
        ranks = set(group_ranks(group, self.group_size, self.size))
        if 0 in ranks:
            self.receiver.expect(request_id, dst_block_ids, deadline, source_tp)
        self._begin(request_id, ranks)
        followers = ranks - {0}
        if not followers:  # rank 0 alone: ready once its expect returned
            self._now_ready(request_id)
            return
        self.unconfirmed[request_id] = followers
        for r in sorted(followers):  # monotonic deadlines: the ranks share one host clock
            self._side(r, ExpectCmd(request_id, tuple(dst_block_ids), deadline, source_tp))

    def _on_report(self, rank: int, report: FromRank) -> None:
        super()._on_report(rank, report)
        if isinstance(report, ExpectedReport):
            waiting = self.unconfirmed.get(report.rid)
            if waiting is not None:
                waiting.discard(rank)
                if not waiting:
                    del self.unconfirmed[report.rid]
                    self._now_ready(report.rid)

    def _ended(self, rid: str) -> None:
        self.unconfirmed.pop(rid, None)

    def take_ready(self) -> list[str]:
        """Reservations every rank now expects, since the last call (rank 0's own receiver
        is ready at expect: its word is not needed)."""
        self.receiver.take_ready()
        return super().take_ready()
