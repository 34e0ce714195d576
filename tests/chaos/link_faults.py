"""Link faults between the network namespaces of a chaos cluster's workers
(tests/netns_hosts.py's NetHub): what each kind does, and its undo.

- ``link_down``: the worker's veth is set down: it is cut off from the router and every
  peer (in-flight KV transfers stall, heartbeats stop, the router drops it), then set up.
- ``partition``: nftables drop rules in one worker's namespace (``ip route prohibit`` where
  nft is missing): either between a producer and a consumer (the KV path alone: pushes to
  that consumer fail, heartbeats go on) or between a worker and the router (heartbeats and
  its gRPC streams stop, its KV path stays).
- ``rate_limit``: a tc token bucket (tbf) at a few Mbit/s on both ends of the worker's
  veth: KV transfers and streams slow down, nothing fails by design.
"""

from __future__ import annotations

import random
from collections.abc import Callable

from netns_hosts import NetHub

from deploy.cluster import ClusterSpec
from deploy.launch_checks import worker_names

LINK_KINDS = ("rate_limit", "partition", "link_down")
WORKERS_2P2D = [name for name, _ in worker_names(2, 2, 0)]
Undo = Callable[[], None]
# (kind, the workers it touches, what was done, how to undo it)
Injected = tuple[str, tuple[str, ...], str, Undo]


def inject_link(kind: str, hub: NetHub, rng: random.Random,
                whole: Callable[[tuple[str, ...]], list[str]],
                any_up: Callable[[tuple[str, ...]], list[str]]) -> Injected | None:
    """Applies one link fault of ``kind``. ``whole(roles)`` lists workers of those roles
    that may be taken away (their role has nobody else down); ``any_up(roles)`` lists every
    healthy worker under no fault. None when no target fits now."""
    if kind == "rate_limit":
        names = any_up(("producer", "consumer"))
        if not names:
            return None
        w = rng.choice(names)
        detail = hub.rate_limit(w, rng.choice((2, 4, 8, 16)))
        return kind, (w,), detail, lambda: hub.unlimit(w)
    if kind == "link_down":
        names = whole(("producer", "consumer"))
        if not names:
            return None
        w = rng.choice(names)
        detail = hub.link_down(w)
        return kind, (w,), detail, lambda: hub.link_up(w)
    if kind == "partition":
        ps, cs = whole(("producer",)), whole(("consumer",))
        if rng.random() < 0.5 and ps and cs:  # the KV path between one pair
            p, c = rng.choice(ps), rng.choice(cs)
            peers = [hub.addr[c]]
            detail = hub.partition(p, peers) + f" ({c}): KV path {p} <-> {c} cut"
            return kind, (p, c), detail, lambda: hub.heal(p, peers)
        names = ps + cs
        if not names:
            return None
        w = rng.choice(names)
        peers = [hub.hub_addr]
        detail = hub.partition(w, peers) + f" (router): {w} <-> router cut"
        return kind, (w,), detail, lambda: hub.heal(w, peers)
    raise ValueError(f"kind: not a link fault: {kind!r}")


def netns_spec(hub: NetHub, worker_args: tuple[str, ...], router_args: tuple[str, ...],
               producers: int = 2, consumers: int = 2) -> ClusterSpec:
    """A cluster whose workers each run on their own host of ``hub`` (the router on the
    bridge), KV over UCX on TCP: shared memory would pass under every link fault."""
    names = [name for name, _ in worker_names(producers, consumers, 0)]
    return ClusterSpec(producers=producers, consumers=consumers, host=hub.hub_addr,
                       worker_args=worker_args, router_args=router_args, worker_metrics=False,
                       env={"UCX_TLS": "tcp", "UCX_NET_DEVICES": "all"},
                       netns={w: (hub.ns[w], hub.addr[w]) for w in names})
