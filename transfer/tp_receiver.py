"""The consumer's receiver across its TP ranks: one receiver per rank, each on its own pool
shard taking exactly its heads (transfer.tp_plan), advertised together as one
comma-joined address in rank order (transfer.tp_endpoints).

A reservation is ready to announce to the producer only once every rank has its record
(``take_ready``, the contract's): a push reaching a rank that has not processed its expect
yet would be refused as an unknown request. The KV has landed only when every rank's part
landed.
"""

from __future__ import annotations

from collections.abc import Sequence

from engine.kv_layout import KVLayout
from transfer.base import KVReceiver
from transfer.tp_endpoints import RankChannel, TPEndpoints, attach_ranks, join_addresses
from transfer.tp_messages import ExpectCmd, ExpectedReport, FromRank, RankSideInfo
from transfer.types import TransferConfig


def tp_receiver(local: KVReceiver, layout: KVLayout, cfg: TransferConfig,
                followers: RankChannel | None, name: str = "consumer") -> KVReceiver:
    """The worker's receiver: ``local`` alone on one rank; with followers, ``local`` plus an
    endpoint on every follower rank (started here), acting as one. Closes ``local`` if
    that fails."""
    if followers is None:
        return local
    try:
        infos = attach_ranks(followers, "consumer", layout, cfg, name)
    except BaseException:
        local.close()
        raise
    return TPReceiver(local, followers, infos)


class TPReceiver(TPEndpoints, KVReceiver):
    def __init__(self, local: KVReceiver, followers: RankChannel,
                 infos: list[RankSideInfo]) -> None:
        super().__init__(local, followers)
        self.receiver = local
        self.size = 1 + len(infos)
        self._address = join_addresses([local.address, *(i.address for i in infos)])
        self.unconfirmed: dict[str, set[int]] = {}  # rid -> follower ranks yet to expect it

    @property
    def address(self) -> str:
        return self._address

    def expect(self, request_id: str, dst_block_ids: Sequence[int],
               deadline: float | None = None, source_tp: int | None = None) -> None:
        self.receiver.expect(request_id, dst_block_ids, deadline, source_tp)
        self._begin(request_id, set(range(self.size)))
        self.unconfirmed[request_id] = set(range(1, self.size))
        for r in range(1, self.size):  # monotonic deadlines: the ranks share one host clock
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
