"""Which attention data-parallel group of a worker serves a request.

A worker of --data-parallel-size D reports each group's own queues and KV pool in its
heartbeat (WorkerLoad.dp_ranks). The router sends a request to the least loaded group (on
a producer and on a consumer alike: the KV then moves from the producer group's ranks to
the consumer group's, which pair as two workers of the groups' TP size would):
waiting + running requests as of that heartbeat, plus those the router sent to the group
since (heartbeats are about a second apart; without this count a burst would all land on
the group that looked idlest), then the most free blocks. A worker of one group reports
none and places the request itself.
"""

from __future__ import annotations

from router.control.registry import WorkerInfo


def pick_dp_rank(w: WorkerInfo) -> int | None:
    """The group for one more request on ``w`` (counted as sent), or None: one group."""
    ranks = w.load.dp_ranks
    if len(ranks) < 2:
        return None
    if len(w.dp_sent) != len(ranks):
        w.dp_sent = [0] * len(ranks)
    sent = w.dp_sent
    g = min(range(len(ranks)), key=lambda i: (ranks[i].waiting + ranks[i].running + sent[i],
                                               -ranks[i].kv_blocks_free))
    sent[g] += 1
    return g


def attention_tp(w: WorkerInfo) -> int:
    """Ranks of one of ``w``'s attention groups: what its KV layout is split over, and so
    the TP size a consumer's ranks pair with (its whole TP without DP attention)."""
    return max(1, w.tp_size // max(1, w.dp_size))
