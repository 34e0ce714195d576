"""The consumer's receiver across its TP ranks: one receiver per rank, each on its own pool
shard taking exactly its heads (transfer.tp_plan), advertised together as one
comma-joined address in rank order (worker.tp_endpoints).

A reservation is announced to the producer only once every rank has its record
(``take_ready``): a push reaching a rank that has not processed its expect yet would be
refused as an unknown request. The KV has landed only when every rank's part landed.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from engine.parallel.followers import TPFollowers
from transfer.base import KVReceiver
from worker.tp_endpoints import TPEndpoints, join_addresses


class TPReceiver(TPEndpoints, KVReceiver):
    def __init__(self, local: KVReceiver, followers: TPFollowers,
                 infos: list[dict[str, Any]]) -> None:
        super().__init__(local, followers)
        self.receiver = local
        self.size = 1 + len(infos)
        self._address = join_addresses([local.address, *(i["address"] for i in infos)])
        self.unconfirmed: dict[str, set[int]] = {}  # rid -> follower ranks yet to expect it
        self.ready: list[str] = []

    @property
    def address(self) -> str:
        return self._address

    def expect(self, request_id: str, dst_block_ids: Sequence[int],
               deadline: float | None = None, source_tp: int | None = None) -> None:
        self.receiver.expect(request_id, dst_block_ids, deadline, source_tp)
        self._begin(request_id, set(range(self.size)))
        self.unconfirmed[request_id] = set(range(1, self.size))
        for r in range(1, self.size):  # monotonic deadlines: the ranks share one host clock
            self._side(r, ("expect", request_id, list(dst_block_ids), deadline, source_tp))

    def _on_report(self, rank: int, report: Any) -> None:
        super()._on_report(rank, report)
        if report[0] == "expected":
            waiting = self.unconfirmed.get(report[1])
            if waiting is not None:
                waiting.discard(rank)
                if not waiting:
                    del self.unconfirmed[report[1]]
                    self.ready.append(report[1])

    def _ended(self, rid: str) -> None:
        self.unconfirmed.pop(rid, None)

    def take_ready(self) -> list[str]:
        """Reservations every rank now expects, since the last call."""
        out, self.ready = self.ready, []
        return out
