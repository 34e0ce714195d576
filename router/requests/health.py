"""Why the cluster cannot serve right now, in words for /health and the logs; and holding
new requests while a role change rebuilds the only workers that could serve them."""

from __future__ import annotations

import asyncio
import contextlib

from router.control.registry import COLOCATED, CONSUMER, PRODUCER, ROLE_NAMES, Registry
from router.requests.dispatcher import no_workers_message


def unhealthy_reason(registry: Registry) -> str | None:
    """None while a request can be placed; otherwise what is missing and which workers are
    unhealthy (e.g. a KV pool exhausted by orphaned requests)."""
    if registry.serving():
        return None
    parts = [no_workers_message(registry)]
    parts += [f"{w.role_name} {w.worker_id}: {w.unhealthy_reason}"
              for w in sorted(registry.all(), key=lambda w: w.worker_id) if not w.healthy]
    return "; ".join(parts)


def usable_counts(registry: Registry) -> dict[str, int]:
    return {ROLE_NAMES[r]: len(registry.usable(r)) for r in (PRODUCER, CONSUMER, COLOCATED)}


# Requests held at once while a role change leaves no usable worker; past it, refused as
# if no change ran (a flood during a change must not grow the router without bound).
MAX_HELD = 1024


async def wait_until_serving(registry: Registry) -> bool:
    """True once a request can be placed. While a role change holds requests
    (``registry.hold_until``), waits for it; otherwise answers at once."""
    if registry.serving():
        return True
    if registry.held >= MAX_HELD:
        return False
    changed = asyncio.Event()
    registry.on_change.append(changed.set)
    registry.held += 1
    try:
        while not registry.serving():
            left = registry.hold_until - registry.clock()
            if left <= 0:
                return False
            changed.clear()
            # a timeout too: hold_until may move, and expiry is no registry change
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(changed.wait(), min(left, 1.0))
        return True
    finally:
        registry.held -= 1
        registry.on_change.remove(changed.set)
