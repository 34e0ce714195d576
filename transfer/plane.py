"""The narrow seam under the network sender/receiver: how bytes move, nothing else.

All methods are called from the owning side's I/O thread only.
Tags are 64-bit and unique per (sender session, message); the receiver matches on them.

A ``cut`` (``transfer.head_cut``) is given when the two pools split the KV heads
differently (producer and consumer of different TP): the run's bytes are then only the
part's heads, a pitched region on each side, and each plane moves it its own way.
Without one, whole blocks of equal size move.
"""

from __future__ import annotations

import abc
from collections.abc import Callable

from transfer.head_cut import HeadCut
from transfer.pool import KVPool


class DataPlane(abc.ABC):
    pull = False  # see PullPlane

    def __init__(self, pool: KVPool) -> None:
        self.pool = pool
        self.wake: Callable[[], None] = _no_wake  # set by the owner: wakes its I/O loop

    @abc.abstractmethod
    def local_info(self) -> bytes:
        """Opaque bytes a peer needs to reach this side (worker address, agent metadata)."""

    @abc.abstractmethod
    def add_peer(self, info: bytes) -> object:
        """A handle for a peer from its ``local_info``."""

    @abc.abstractmethod
    def remove_peer(self, peer: object) -> None:
        """Drops the peer; operations still posted to it are cancelled."""

    @abc.abstractmethod
    def send(self, peer: object, tag: int, src_block: int, dst_block: int,
             num_blocks: int, cut: HeadCut | None = None) -> object:
        """Posts one run's bytes to the peer; returns an op for ``test``."""

    @abc.abstractmethod
    def recv(self, peer: object, tag: int, dst_block: int | None, num_blocks: int,
             src_block: int, cut: HeadCut | None = None) -> object:
        """Posts the landing of one run (``src_block``: where it starts in the producer's
        pool, for pull planes); ``dst_block`` None drains it to nowhere."""

    @abc.abstractmethod
    def test(self, op: object) -> bool:
        """True once the op completed; raises TransferError if it failed."""

    def flush(self) -> None:  # noqa: B027 - optional hook
        """Called after the receives of one announce were posted (planes may batch)."""

    def progress(self) -> None:  # noqa: B027 - optional hook, most planes progress themselves
        """Called every I/O-loop turn."""

    @abc.abstractmethod
    def close(self) -> None:
        """Deregisters the pool and releases every resource."""


class PullPlane(DataPlane):
    """The consumer reads each run itself (one-sided): the producer posts nothing, and a
    run nobody wants is simply not read. Why: only the reader decides when its blocks
    change, so no late write of a cancelled transfer can land in blocks already handed to
    another request. The producer keeps a cancelled request's source blocks until the
    consumer answered (``pull``)."""

    pull = True

    def send(self, peer: object, tag: int, src_block: int, dst_block: int,
             num_blocks: int, cut: HeadCut | None = None) -> object:
        return None  # the consumer reads the run when the announce reaches it

    def recv(self, peer: object, tag: int, dst_block: int | None, num_blocks: int,
             src_block: int, cut: HeadCut | None = None) -> object:
        if dst_block is None:
            return None  # nothing moves until read: an unwanted run needs no drain
        return self.read(peer, src_block, dst_block, num_blocks, cut)

    @abc.abstractmethod
    def read(self, peer: object, src_block: int, dst_block: int, num_blocks: int,
             cut: HeadCut | None = None) -> object:
        """Starts reading one run from the peer's pool into ours; an op for ``test``
        (None: already done)."""


def _no_wake() -> None:
    pass
