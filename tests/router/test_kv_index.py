"""The router's KV index (router/control/kv_index.py) on hand-made event batches: snapshots,
events in order, resync after a gap / another epoch / a new registration, the per-worker
bound against a worker that sends too much, and bad batches refused by field."""

from __future__ import annotations

import pytest
from pdserve.v1 import common_pb2, worker_pb2

from engine.prefix_hash import block_hashes, chain_root
from router.control.kv_index import KVEventError, KVIndex
from router.control.registry import CONSUMER, Registry, WorkerInfo

BS = 4


def _reg(total: int = 100) -> tuple[Registry, WorkerInfo]:
    reg = Registry(heartbeat_timeout_s=3.0)
    w = reg.register(worker_id="c0", role=CONSUMER, address="c0:1", kv_address="kv",
                     model="m", kv_fingerprint="fp", max_model_len=512,
                     load=common_pb2.WorkerLoad(kv_blocks_total=total, kv_blocks_free=total),
                     block_size=BS, prefix_caching=True, accepts_cache_salt=True)
    return reg, w


def _chain(tokens: list[int]) -> list[bytes]:
    return block_hashes(tokens, BS, chain_root("fp"))


def _snap(epoch: int, seq: int, hs: list[bytes]) -> worker_pb2.KVEventBatch:
    return worker_pb2.KVEventBatch(worker_id="c0", epoch=epoch, snapshot=worker_pb2.KVCacheSnapshot(
        seq=seq, block_hashes=hs))


def _events(epoch: int, *evs: tuple[int, bool, list[bytes]]) -> worker_pb2.KVEventBatch:
    return worker_pb2.KVEventBatch(worker_id="c0", epoch=epoch, events=[
        worker_pb2.KVBlockEvent(seq=s, removed=r, block_hashes=hs) for s, r, hs in evs])


def test_snapshot_then_events_in_order_and_resync_on_a_gap() -> None:
    _, w = _reg()
    idx = KVIndex()
    a = _chain(list(range(40)))  # 10 blocks
    # events before any snapshot: the router knows nothing of this epoch
    assert idx.apply(w, _events(7, (1, False, a[:2]))).resync
    assert not idx.apply(w, _snap(7, 3, a[:4])).resync
    assert idx.cached_blocks(w, a) == 4
    # seq 3 is in the snapshot already; 4 and 5 follow it
    got = idx.apply(w, _events(7, (3, False, a[:4]), (4, False, a[4:6]), (5, True, [a[1]])))
    assert not got.resync and got.known
    assert idx.cached_blocks(w, a) == 1  # block 1 evicted: the chain breaks there
    assert idx.size(w) == 5
    # a gap (6 missing): the view goes, the worker must send a snapshot
    assert idx.apply(w, _events(7, (7, False, a[6:7]))).resync
    assert idx.cached_blocks(w, a) == 0 and idx.resyncs == 2
    # another epoch (the engine restarted) is not applied on the old view either
    assert not idx.apply(w, _snap(7, 9, a)).resync
    assert idx.apply(w, _events(8, (1, False, a[:1]))).resync
    assert idx.cached_blocks(w, a) == 0


def test_a_new_registration_or_an_unknown_worker_starts_empty() -> None:
    reg, w = _reg()
    idx = KVIndex()
    a = _chain(list(range(16)))
    idx.apply(w, _snap(1, 1, a))
    w2 = reg.register(worker_id="c0", role=CONSUMER, address="c0:1", kv_address="kv",
                      model="m", kv_fingerprint="fp", max_model_len=512, block_size=BS)
    assert idx.cached_blocks(w2, a) == 0  # the old view is not the new incarnation's
    assert idx.apply(w2, _events(1, (2, False, a[:1]))).resync
    idx.apply(w, _snap(1, 1, a))
    idx.forget(w)  # dropped by the registry
    assert idx.size(w) == 0
    assert not idx.apply(None, _snap(1, 1, a)).known


def test_a_worker_sending_more_than_its_pool_is_trimmed_to_it() -> None:
    """A hostile (or broken) worker's events cannot grow the router's memory past its pool:
    the oldest hashes go."""
    _, w = _reg(total=8)
    idx = KVIndex()
    many = [bytes([i % 256, i // 256]) * 16 for i in range(1000)]
    idx.apply(w, _snap(1, 1, many[:500]))
    assert idx.size(w) == 8 and idx.trimmed == 492
    for i in range(50):
        idx.apply(w, _events(1, (2 + i, False, many[500 + 10 * i:510 + 10 * i])))
    assert idx.size(w) == 8 and idx.total() == 8
    # what it kept is the newest: the index answers for those only
    assert idx.cached_blocks(w, many[-8:-7]) == 1 and idx.cached_blocks(w, many[:1]) == 0


@pytest.mark.parametrize(("batch", "field"), [
    (worker_pb2.KVEventBatch(epoch=1), "worker_id"),
    (worker_pb2.KVEventBatch(worker_id="c0"), "epoch"),
    (worker_pb2.KVEventBatch(worker_id="c0", epoch=1,
                             events=[worker_pb2.KVBlockEvent(seq=0)]), "events[0].seq"),
    (worker_pb2.KVEventBatch(worker_id="c0", epoch=1, events=[
        worker_pb2.KVBlockEvent(seq=1, block_hashes=[b"short"])]), "block_hashes"),
])
def test_bad_batches_name_their_field(batch: worker_pb2.KVEventBatch, field: str) -> None:
    _, w = _reg()
    with pytest.raises(KVEventError, match=rf"^{field.replace('[', '.').replace(']', '.')}: "):
        KVIndex().apply(w, batch)
