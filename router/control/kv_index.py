"""The router's index of which worker holds which prompt blocks in its prefix cache, fed by
the workers' KV events (Registry.PublishKVEvents, worker/kv_publisher.py).

A block is named by its chain hash (engine/prefix_hash.py): the hash of a block covers every
token before it, so "worker W holds the first k blocks of this prompt" is "the prompt's first
k chain hashes are all in W's set". Each worker's view is one insertion-ordered set.

Per worker: ``(registration, epoch, seq)``. A batch applies only to the registration it was
registered under (a re-registered worker starts empty), in its epoch (a new engine starts a
new epoch at seq 1), with its events following the last one applied; anything else drops the
view and answers ``resync``, and the worker's next batch is a snapshot. Bounded: a view
holds at most its worker's KV pool (``kv_blocks_total``, itself capped by
MAX_BLOCKS_PER_WORKER); a worker sending more (a bug, or hostile) loses its oldest hashes,
never the router's memory. Hashes are checked for their size.

The index decides only where a request runs. Nothing a worker reports here reaches a token:
a stale or false view costs a prefill the worker then computes, nothing else.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pdserve.v1 import worker_pb2

from engine.prefix_hash import HASH_BYTES
from router.control.registry import WorkerInfo

# Whatever a worker reports, its view never holds more (32-byte hashes: 64 MiB of them
# across 16 workers at this bound, the size of the biggest real pools' block counts).
MAX_BLOCKS_PER_WORKER = 1 << 20


class KVEventError(ValueError):
    """A malformed batch; the message starts with the field."""


@dataclass
class WorkerKV:
    worker: WorkerInfo  # the registration the view belongs to
    epoch: int
    seq: int
    cap: int
    held: dict[bytes, None] = field(default_factory=dict)  # oldest first

    def add(self, hashes: list[bytes]) -> int:
        """Returns how many of the oldest hashes went to stay within ``cap``."""
        for h in hashes:
            self.held.pop(h, None)  # stored again: now the newest
            self.held[h] = None
        over = max(0, len(self.held) - self.cap)
        for _ in range(over):
            del self.held[next(iter(self.held))]
        return over

    def remove(self, hashes: list[bytes]) -> None:
        for h in hashes:
            self.held.pop(h, None)


@dataclass(frozen=True)
class Applied:
    known: bool  # the worker is registered
    resync: bool  # its view was dropped: the next batch must be a snapshot


class KVIndex:
    def __init__(self) -> None:
        self._views: dict[str, WorkerKV] = {}
        self.batches = 0
        self.resyncs = 0  # views dropped for a gap, an epoch or a registration change
        self.trimmed = 0  # hashes dropped past a worker's bound

    def apply(self, worker: WorkerInfo | None, batch: worker_pb2.KVEventBatch) -> Applied:
        """One batch from ``worker`` (its current registration, None: unknown)."""
        _check(batch)
        wid = batch.worker_id
        if worker is None:
            self._views.pop(wid, None)
            return Applied(False, True)
        view = self._views.get(wid)
        if batch.HasField("snapshot"):
            cap = _cap(worker)
            view = WorkerKV(worker, batch.epoch, batch.snapshot.seq, cap)
            self.trimmed += view.add(list(batch.snapshot.block_hashes))
            self._views[wid] = view
        elif view is None or view.worker is not worker or view.epoch != batch.epoch:
            return self._resync(wid)
        self.batches += 1
        for ev in batch.events:
            if ev.seq <= view.seq:  # already in the snapshot it follows
                continue
            if ev.seq != view.seq + 1:
                return self._resync(wid)
            if ev.removed:
                view.remove(list(ev.block_hashes))
            else:
                self.trimmed += view.add(list(ev.block_hashes))
            view.seq = ev.seq
        return Applied(True, False)

    def _resync(self, wid: str) -> Applied:
        self._views.pop(wid, None)
        self.resyncs += 1
        return Applied(True, True)

    def forget(self, worker: WorkerInfo) -> None:
        """The registration left (dropped, replaced): its view goes with it."""
        view = self._views.get(worker.worker_id)
        if view is not None and view.worker is worker:
            del self._views[worker.worker_id]

    def cached_blocks(self, worker: WorkerInfo, hashes: list[bytes]) -> int:
        """How many leading blocks of a chain ``worker`` reported holding."""
        view = self._views.get(worker.worker_id)
        if view is None or view.worker is not worker:
            return 0
        held = view.held
        n = 0
        for h in hashes:
            if h not in held:
                break
            n += 1
        return n

    def size(self, worker: WorkerInfo) -> int:
        view = self._views.get(worker.worker_id)
        return len(view.held) if view is not None and view.worker is worker else 0

    def total(self) -> int:
        return sum(len(v.held) for v in self._views.values())


def _cap(worker: WorkerInfo) -> int:
    total = worker.load.kv_blocks_total
    return max(1, min(total or MAX_BLOCKS_PER_WORKER, MAX_BLOCKS_PER_WORKER))


def _check(batch: worker_pb2.KVEventBatch) -> None:
    if not batch.worker_id:
        raise KVEventError("worker_id: must not be empty")
    if not batch.epoch:
        raise KVEventError("epoch: must be > 0")
    hashes = [batch.snapshot.block_hashes] if batch.HasField("snapshot") else []
    for i, ev in enumerate(batch.events):
        if not ev.seq:
            raise KVEventError(f"events[{i}].seq: must be > 0")
        hashes.append(ev.block_hashes)
    for hs in hashes:
        for h in hs:
            if len(h) != HASH_BYTES:
                raise KVEventError(f"block_hashes: each must be {HASH_BYTES} bytes, got "
                                   f"{len(h)}")
