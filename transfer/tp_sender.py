"""The producer's sender across its TP ranks (and across a consumer's ranks).

Rank 0 decides every push; each producer rank moves only its own heads, to the consumer
ranks ``transfer.tp_plan.parts_from`` names: rank 0 through its local sender, followers
through their rank sides (transfer.tp_rank_side), the messages queued behind the step plan
that filled the blocks. A one-rank producer uses the same path with no followers, which is
also what splits a TP consumer's comma-joined address (transfer.tp_endpoints).

Under data-parallel attention (transfer.tp_groups) only the ranks of the request's own
attention group push, each as the rank of a TP worker of the group's size: the consumer's
address names the ranks of its group, so the plan pairs the two groups rank to rank and
no other rank of either worker takes part. Each of those ranks connects at its first push
(rank 0's group may hold none of the request).

A replicated latent (an MLA pool) leaves from one producer rank of the group, the one
``tp_plan.latent_source`` names for the request, to the consumer's first rank only: the
consumer copies it to its other ranks, so the wire carries it once per request.
"""

from __future__ import annotations

from collections.abc import Sequence

from engine.kv_layout import KVLayout
from transfer.base import KVSender
from transfer.tp_endpoints import RankChannel, TPEndpoints, attach_ranks, split_addresses
from transfer.tp_groups import GroupOf, group_ranks
from transfer.tp_messages import FinishCmd, PushCmd
from transfer.tp_plan import is_latent, latent_source, parts_from
from transfer.types import TransferConfig, TransferNotice


def tp_sender(local: KVSender, layout: KVLayout, cfg: TransferConfig,
              followers: RankChannel | None, name: str = "producer",
              group_of: GroupOf | None = None) -> KVSender:
    """The worker's sender: ``local`` (rank 0's, on its pool shard) plus an endpoint on
    every follower rank (started here), acting as one. Closes ``local`` if that fails.
    group_of: under data-parallel attention, the group holding a request's KV."""
    try:
        infos = [] if followers is None else attach_ranks(followers, "producer", layout,
                                                          cfg, name)
    except BaseException:
        local.close()
        raise
    return TPSender(local, layout, followers, 1 + len(infos), group_of)


class TPSender(TPEndpoints, KVSender):
    def __init__(self, local: KVSender, layout: KVLayout, followers: RankChannel | None,
                 ranks: int = 0, group_of: GroupOf | None = None) -> None:
        super().__init__(local, followers)
        self.sender = local
        self.tp = layout.tp_size  # ranks of one attention group (all of them without DP)
        self.ranks = ranks or self.tp  # every rank of the worker
        group_ranks(0, self.tp, self.ranks)  # ValueError: the groups do not split the ranks
        self.heads = layout.num_kv_heads
        self.latent = is_latent(layout)  # moved once per request (module docstring)
        self.group_of = group_of

    @property
    def data_parallel(self) -> bool:
        return self.ranks > self.tp

    def _targets(self, rank: int, addresses: list[str], rid: str) -> list[str]:
        """The consumer rank addresses worker ``rank`` sends its heads to (rank r of the
        worker is rank r % tp of its attention group)."""
        source = latent_source(rid, self.tp) if self.latent else 0
        return [addresses[p.dst_rank]
                for p in parts_from(rank % self.tp, self.tp, len(addresses), self.heads,
                                    self.latent, source)]

    def connect(self, address: str, timeout: float | None = None) -> None:
        """Rank 0's connections; followers connect with their first push (blocking only
        their own rank, while rank 0 handshakes here). Under data-parallel attention
        nothing here: which ranks send depends on the request's group, so every sending
        rank, rank 0 included, connects at its first push."""
        if self.data_parallel:
            return
        addresses = split_addresses(address)
        # a latent goes to the consumer's first rank, from whichever rank a request names
        targets = addresses[:1] if self.latent else self._targets(0, addresses, "")
        for a in targets:
            self.sender.connect(a, timeout)

    def push(self, request_id: str, peer: str, src_block_ids: Sequence[int],
             dst_block_ids: Sequence[int], deadline: float | None = None,
             after: object | None = None) -> None:
        """``after`` is rank 0's event: the other ranks' pushes wait for their own
        stream's work so far."""
        addresses = split_addresses(peer)
        rec = self.recs.get(request_id)
        new = rec is None
        if rec is None:
            group = self.group_of(request_id) if self.group_of is not None else 0
            ranks = {r for r in group_ranks(group, self.tp, self.ranks)
                     if self._targets(r, addresses, request_id)}
            rec = self._begin(request_id, ranks)
        try:
            if 0 in rec.ranks:
                for a in self._targets(0, addresses, request_id):
                    if self.data_parallel:  # idempotent: a handshake only the first time
                        self.sender.connect(a)
                    self.sender.push(request_id, a, src_block_ids, dst_block_ids, deadline,
                                     after)
        except BaseException:
            if new:  # nothing else went out: no record anywhere
                del self.recs[request_id]
            raise
        for r in sorted(rec.ranks - {0}):
            self._side(r, PushCmd(request_id, tuple(self._targets(r, addresses, request_id)),
                                  tuple(src_block_ids), tuple(dst_block_ids), deadline))

    def finish(self, request_id: str, notice: TransferNotice) -> None:
        rec = self.recs[request_id]
        for r in sorted(rec.ranks):
            if r == 0:
                self.sender.finish(request_id, notice)
            else:
                self._side(r, FinishCmd(request_id, notice))
