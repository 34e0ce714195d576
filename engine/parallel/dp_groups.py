"""Data-parallel attention inside one tensor-parallel engine: T ranks in D attention groups.

Rank r belongs to attention group r // A (A = T / D ranks each) and is rank r % A in it.
Everything but the MoE layers (embedding, attention and its KV, dense MLPs, final norm, LM
head) is tensor-parallel inside the attention group exactly as a TP-A engine splits it, so
each group holds its own requests and its own KV pool; with A = 1 every rank holds those
layers whole and runs no collective for them. The MoE layers are expert-parallel over all
T ranks: rank r holds experts [r E / T, (r + 1) E / T) and 1 / T of the shared experts'
columns (engine/parallel/dp_exchange.py moves the tokens).

The model is built with an ``AttentionGroup`` where a TP engine passes its ``TPGroup``: it
has the same collectives (over the A ranks of the group) and carries the expert group.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist

from engine.parallel.group import TPGroup

FLAG = "--data-parallel-size"


@dataclass(frozen=True)
class DPLayout:
    """Where a rank sits: which attention group, and its rank within it."""

    tp_size: int  # T: every rank of the engine
    dp_size: int  # D: attention groups

    @property
    def attn_size(self) -> int:  # A = T / D ranks per attention group
        return self.tp_size // self.dp_size

    def dp_rank(self, rank: int) -> int:
        return rank // self.attn_size

    def attn_rank(self, rank: int) -> int:
        return rank % self.attn_size

    def ranks_of(self, dp_rank: int) -> range:
        """The engine ranks of attention group dp_rank."""
        a = self.attn_size
        return range(dp_rank * a, (dp_rank + 1) * a)


def check_dp(tp_size: int, dp_size: int, is_moe: bool) -> DPLayout:
    """ValueError naming the flag for a layout this engine cannot run."""
    if dp_size < 1 or tp_size % dp_size:
        raise ValueError(f"{FLAG}: must be >= 1 and divide --tensor-parallel-size {tp_size}, "
                         f"got {dp_size}")
    if dp_size > 1 and not is_moe:
        # a dense model has no layer to share across the groups: D separate engines serve it
        raise ValueError(f"{FLAG}: {dp_size} needs a mixture-of-experts model (a dense "
                         "model runs as separate workers instead)")
    return DPLayout(tp_size, dp_size)


class AttentionGroup(TPGroup):
    """The collectives of one attention group (its A ranks), plus ``ep``: the expert group
    over every rank of the engine, which the MoE layers use."""

    def __init__(self, ep: TPGroup, layout: DPLayout, store: dist.Store) -> None:
        a = layout.attn_size
        self.layout = layout
        self.ep = ep
        self.rank, self.size, self.device = layout.attn_rank(ep.rank), a, ep.device
        self.timeout_s, self.host_staged = ep.timeout_s, ep.host_staged
        if a > 1:  # its own communicator: A ranks under the group's own key prefix
            g = layout.dp_rank(ep.rank)
            sub = TPGroup(dist.PrefixStore(f"attn{g}", store), self.rank, a, ep.device,
                          ep.timeout_s, ep.host_staged)
            self.pg = sub.pg
        else:
            self.pg = None

    @property
    def dp_rank(self) -> int:
        return self.layout.dp_rank(self.ep.rank)

    def abort(self) -> None:
        if self.pg is not None:
            super().abort()
        self.ep.abort()


def make_attention_group(ep: TPGroup, store: dist.Store, tp_size: int,
                         dp_size: int) -> AttentionGroup:
    """Every rank calls this at start-up, in the same order (the sub-communicators pair up
    over the store)."""
    return AttentionGroup(ep, DPLayout(tp_size, dp_size), store)


def ep_of(group: TPGroup | None) -> TPGroup | None:
    """The expert-parallel group a model built on ``group`` uses (None: not DP attention)."""
    return group.ep if isinstance(group, AttentionGroup) else None
