"""Which ranks of a worker hold a request's KV, under data-parallel attention.

A worker of T ranks in D attention groups (``--data-parallel-size``) keeps each request's
KV only in its own group's pools: group g is ranks [g A, (g + 1) A), A = T / D, and its
rank g A + a holds the heads a rank a of a TP-A worker holds (the layout's ``tp_size`` is
A, its ``tp_rank`` a). Without data-parallel attention D = 1 and the one group is every
rank. The engine places each request on a group (``Request.dp_rank``); the TP sender and
receiver ask it through a ``GroupOf`` and move bytes only on that group's ranks, so the
other groups' ranks neither send nor receive any of it.
"""

from __future__ import annotations

from collections.abc import Callable

GroupOf = Callable[[str], int]  # request id -> the attention group that holds its KV


def group_ranks(group: int, group_size: int, ranks: int) -> range:
    """The worker ranks of attention group ``group`` (``group_size`` ranks each, of
    ``ranks``); ValueError naming the field for a group the worker does not have."""
    if group_size < 1 or ranks % group_size:
        raise ValueError(f"tp_size: {group_size} ranks per attention group cannot split a "
                         f"worker of {ranks} ranks")
    if not 0 <= group < ranks // group_size:
        raise ValueError(f"dp_rank: must be in [0, {ranks // group_size}), got {group!r}")
    return range(group * group_size, (group + 1) * group_size)
