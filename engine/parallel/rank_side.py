"""A side channel between rank 0 and each follower rank, next to the step plans.

A role that needs each rank to own something beside its KV pool (a KV transfer endpoint on
that rank's pool shard) attaches a *rank side* to every follower: rank 0 names a factory
``"module:function"`` that the follower imports (the engine imports no transfer or service
code itself), and the follower calls ``factory(kv_cache, rank, size, args)``. Everything
between rank 0's user of the side and the side itself (``args``, ``info``, messages and
reports) is bytes to the engine: the side encodes and checks it with a codec of its own.

Ordering: side messages travel in the same pipe as the step plans, so a follower applies a
message only after every forward rank 0 sent before it (a push of blocks after the step that
filled them). Reports flow back on the follower's channel; rank 0 reads them without waiting
(``TPFollowers.reports``).
"""

from __future__ import annotations

import importlib
from typing import Any, Protocol

import torch


class RankSide(Protocol):
    def info(self) -> bytes:
        """What rank 0 learns once the side is up (e.g. this rank's KV address)."""

    def on_message(self, msg: bytes) -> None:
        """Applies one message rank 0 sent this rank (never raises for a bad request:
        reports it instead, so one request cannot stop the rank)."""

    def poll(self) -> list[bytes]:
        """Reports for rank 0 since the last poll."""

    def close(self) -> None: ...


def load_factory(name: str) -> Any:
    """``"package.module:function"`` -> the function; ValueError naming the bad part."""
    module, sep, fn = name.partition(":")
    if not sep or not module or not fn:
        raise ValueError(f"rank side factory: expected 'module:function', got {name!r}")
    return getattr(importlib.import_module(module), fn)


def attach(name: str, kv_cache: torch.Tensor, rank: int, size: int, args: bytes) -> RankSide:
    side: RankSide = load_factory(name)(kv_cache, rank, size, args)
    return side
