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

A replicated latent (an MLA pool, ``tp_plan.is_latent``) is received by the group's first
rank alone (the producer sends it there only, ``transfer.tp_plan``); when it has landed
there, rank 0 has the rank channel copy the request's blocks to the group's other ranks
(``RankChannel.copy_blocks``, a broadcast behind the step plans sent so far) before it
reports the request DONE, so decode never reads a rank's blocks before they hold it. A
copy that fails (a rank died) ends the request FAILED: the handler frees its blocks as
for any failed transfer, and the dead rank fails the worker at its next step.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from engine.kv_layout import KVLayout
from transfer.base import KVReceiver
from transfer.tp_endpoints import RankChannel, TPEndpoints, attach_ranks, join_addresses
from transfer.tp_groups import GroupOf, group_ranks
from transfer.tp_messages import ExpectCmd, ExpectedReport, FromRank, RankSideInfo
from transfer.tp_plan import is_latent
from transfer.types import TransferConfig, TransferStatus, TransferUpdate


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
    return TPReceiver(local, followers, infos, layout.tp_size, group_of, is_latent(layout))


class TPReceiver(TPEndpoints, KVReceiver):
    def __init__(self, local: KVReceiver, followers: RankChannel,
                 infos: list[RankSideInfo], group_size: int = 0,
                 group_of: GroupOf | None = None, latent: bool = False) -> None:
        super().__init__(local, followers)
        self.receiver = local
        self.addresses = [local.address, *(i.address for i in infos)]  # one per rank
        self.size = len(self.addresses)
        self.group_size = group_size or self.size  # ranks per attention group
        group_ranks(0, self.group_size, self.size)  # ValueError: groups do not split ranks
        self.group_of = group_of
        self._address = join_addresses(self.addresses)
        self.unconfirmed: dict[str, set[int]] = {}  # rid -> follower ranks yet to expect it
        self.latent = latent  # received by a group's first rank, copied to the others
        # latent requests of a group of several ranks: rid -> (the group's ranks, blocks)
        self.copies: dict[str, tuple[tuple[int, ...], tuple[int, ...]]] = {}

    @property
    def address(self) -> str:
        return self._address

    def address_for(self, request_id: str) -> str:
        """The ranks of the request's attention group (every rank without DP attention)."""
        copy = self.copies.get(request_id)
        if copy is not None:  # the producer sends to the first; it names them all
            return join_addresses([self.addresses[r] for r in copy[0]])
        rec = self.recs.get(request_id)
        if rec is None:
            return self._address
        return join_addresses([self.addresses[r] for r in sorted(rec.ranks)])

    def expect(self, request_id: str, dst_block_ids: Sequence[int],
               deadline: float | None = None, source_tp: int | None = None) -> None:
        group = self.group_of(request_id) if self.group_of is not None else 0
        ranks = set(group_ranks(group, self.group_size, self.size))
        copy = None
        if self.latent and len(ranks) > 1:  # the first rank receives, then copies
            copy = (tuple(sorted(ranks)), tuple(dst_block_ids))
            ranks = {min(ranks)}
        if 0 in ranks:
            self.receiver.expect(request_id, dst_block_ids, deadline, source_tp)
        self._begin(request_id, ranks)
        if copy is not None:
            self.copies[request_id] = copy
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

    def poll(self) -> list[TransferUpdate]:
        """The ranks' combined updates; a latent that landed on its group's first rank is
        copied to the group's other ranks first (DONE only once that copy is issued: every
        later step on those ranks runs after it)."""
        ends = super().poll()
        for i, u in enumerate(ends):
            copy = self.copies.pop(u.request_id, None)
            if copy is None or u.status != TransferStatus.DONE:
                continue
            ranks, blocks = copy
            assert self.followers is not None  # a group of several ranks has followers
            try:
                self.followers.copy_blocks(ranks, blocks)
            except Exception as e:  # noqa: BLE001 - a rank is gone: this request fails
                u = dataclasses.replace(u, status=TransferStatus.FAILED, notice=None,
                                        error=f"copying the latent from rank {ranks[0]} to "
                                              f"ranks {list(ranks[1:])}: {e}",
                                        notice_seen_ns=0, kv_done_ns=0)  # DONE's only
                self.recs[u.request_id].combined = u
                ends[i] = u
        return ends

    def release(self, request_id: str) -> None:
        self.copies.pop(request_id, None)
        super().release(request_id)

    def take_ready(self) -> list[str]:
        """Reservations every rank now expects, since the last call (rank 0's own receiver
        is ready at expect: its word is not needed)."""
        self.receiver.take_ready()
        return super().take_ready()
