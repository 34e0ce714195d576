"""Which attention data-parallel group of a colocated worker serves a request.

A worker of --data-parallel-size D reports each group's own queues and KV pool in its
heartbeat (WorkerLoad.dp_ranks). The router sends a request to the least loaded group:
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
