"""When a worker's KV pool counts as exhausted by orphaned requests (docs/architecture.md).

An orphan is a request that holds blocks but has made no progress for longer than its
lease: a producer's TRANSFERRING request whose destination/ack never came (or whose
cancel never completed), a consumer's reservation whose KV never landed. Leases normally
free these; this is the signal for when they did not, so the router stops sending work to
a worker that cannot admit any (its health says why).
"""

from __future__ import annotations

# "Full": at most this fraction of the pool is free. Not zero: a pool with a handful of
# free blocks still cannot admit a typical prompt.
FULL_FREE_FRACTION = 0.05


def exhausted_by_orphans(free: int, total: int, orphan_blocks: int) -> bool:
    """The pool is full and orphans hold at least half of what is in use."""
    if total <= 0 or orphan_blocks <= 0:
        return False
    used = total - free
    return free <= total * FULL_FREE_FRACTION and orphan_blocks * 2 >= used
