"""The worker's KV events, engine process to gRPC process: a real tiny engine's prefix-cache
events forwarded after a turn (a snapshot instead after a gap in the engine's bounded
queue), mirrored in the gRPC process, and batched for the router with a resync on demand."""

from __future__ import annotations

import asyncio
import os

import pytest
from pdserve.v1 import worker_pb2
from tiny_models import make_tiny_model

from engine.llm import LLM
from engine.prefix_cache import KVEventQueue
from engine.prefix_hash import block_hashes, chain_root
from engine.sampling_params import SamplingParams
from worker import kv_publisher
from worker.kv_forward import KVEventForwarder
from worker.kv_mirror import KVMirror
from worker.kv_publisher import KVPublisher
from worker.messages import Event, KVEventsEvent, KVSnapshotEvent, decode, encode

BS = 4
GREEDY = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> str:
    return make_tiny_model(os.path.join(tmp_path_factory.mktemp("kv"), "llama"), "llama")


def _run(llm: LLM, prompt: list[int]) -> None:
    llm.generate([prompt], GREEDY)


def test_forwarded_events_mirror_the_engine_and_a_gap_sends_a_snapshot(tiny_llama):
    llm = LLM(tiny_llama, block_size=BS, num_kv_blocks=12)
    eng = llm.engine
    sent: list[Event] = []
    fwd = KVEventForwarder(eng, lambda ev: sent.append(decode(encode(ev))))  # the wire
    mirror = KVMirror()
    a = list(range(10, 22))  # 3 full blocks
    _run(llm, a)
    fwd.forward()
    assert len(sent) == 1 and isinstance(sent[0], KVEventsEvent)
    mirror.apply(sent[0])
    root = chain_root(eng.prefix_model_key)
    want = block_hashes(a, BS, root)
    assert [h for h in want if h in mirror] == want and len(mirror) == 3
    fwd.forward()
    assert len(sent) == 1  # nothing new: nothing sent

    # a queue too small for the next prompts: the engine drops events nobody drained
    eng.blocks.cache.events = small = KVEventQueue(max_hashes=2)  # type: ignore[union-attr]
    small.last_seq = fwd.last_seq
    b = list(range(100, 140))  # 10 full blocks in a 12-block pool: evicts some of a's
    _run(llm, b)
    assert small.dropped > 0
    fwd.forward()
    assert isinstance(sent[-1], KVSnapshotEvent) and fwd.snapshots == 1
    mirror.replace(sent[-1])
    snap = eng.kv_cache_snapshot()
    assert mirror.seq == snap.seq and set(mirror.snapshot(1 << 20)) == {h for h, _ in
                                                                         snap.blocks}
    # and from there on, events again, continuing the snapshot's seq
    eng.blocks.cache.events = KVEventQueue()  # type: ignore[union-attr]
    eng.blocks.cache.events.last_seq = snap.seq  # type: ignore[union-attr]
    _run(llm, list(range(200, 208)))
    fwd.forward()
    ev = sent[-1]
    assert isinstance(ev, KVEventsEvent) and ev.items[0].seq == snap.seq + 1
    mirror.apply(ev)
    now = {h for h, _ in eng.kv_cache_snapshot().blocks}
    assert set(mirror.snapshot(1 << 20)) == now and len(mirror) == len(now)


def _stored(seq: int, *hs: bytes) -> KVEventsEvent:
    from worker.messages import KVBlocksEvent

    return KVEventsEvent((KVBlocksEvent(seq, False, hs),))


def test_publisher_batches_resyncs_and_bounds_what_waits(monkeypatch):
    asyncio.run(_publisher_batches(monkeypatch))


async def _publisher_batches(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    pub = KVPublisher("127.0.0.1:1", "w0", "tok")  # its channel needs a running loop
    h = [bytes([i]) * 32 for i in range(8)]
    pub.add(_stored(1, h[0], h[1]))
    first = pub.batch()
    # the router has seen nothing of this epoch: the first batch is a snapshot
    assert first is not None and first.HasField("snapshot") and not first.events
    assert list(first.snapshot.block_hashes) == h[:2] and first.snapshot.seq == 1
    assert (first.worker_id, first.cluster_token, first.epoch) == ("w0", "tok", pub.epoch)
    pub.answered(worker_pb2.KVEventAck(known=True))
    pub.add(_stored(2, h[2]))
    pub.add(_stored(3, h[3]))
    nxt = pub.batch()
    assert nxt is not None and not nxt.HasField("snapshot")
    assert [(e.seq, list(e.block_hashes)) for e in nxt.events] == [(2, [h[2]]), (3, [h[3]])]
    assert pub.batch() is None
    # the router lost its view (restart, gap): the next batch is a snapshot again
    pub.answered(worker_pb2.KVEventAck(known=True, resync=True))
    pub.add(_stored(4, h[4]))
    again = pub.batch()
    assert again is not None and again.snapshot.seq == 4
    assert list(again.snapshot.block_hashes) == h[:5] and not again.events
    # too much waiting: dropped for a snapshot, never unbounded
    pub.answered(worker_pb2.KVEventAck(known=True))
    monkeypatch.setattr(kv_publisher, "MAX_PENDING_HASHES", 2)
    pub.add(_stored(5, h[5], h[6], h[7]))
    assert pub.pending == [] and pub.need_snapshot and pub.dropped == 1
    last = pub.batch()
    assert last is not None and last.snapshot.seq == 5 and len(last.snapshot.block_hashes) == 8
    await pub.close()


def test_publisher_sends_on_the_events_wake_up_and_a_lone_event_still_leaves():
    """Steady events (a decoding consumer's every step): each batch leaves on the wake-up of
    the first event after the interval, no timer of its own, at most one per interval; an
    event with nothing after it leaves within two intervals of the last send."""
    asyncio.run(_publisher_timing())


async def _publisher_timing() -> None:
    interval = 0.1
    pub = KVPublisher("127.0.0.1:1", "w0", "tok", interval_s=interval)
    loop = asyncio.get_running_loop()
    sent: list[tuple[float, float]] = []  # (when it left, when the last event came)
    last_add = [0.0]

    async def fake_send(batch: worker_pb2.KVEventBatch) -> float:
        sent.append((loop.time(), last_add[0]))
        await asyncio.sleep(0.01)  # the call in flight
        return 0.0

    pub._send = fake_send  # type: ignore[method-assign]
    task = asyncio.create_task(pub.run())
    h = [bytes([i % 256]) * 32 for i in range(64)]
    for i in range(20):  # 30 ms apart: 0.6 s
        pub.add(_stored(i + 1, h[i]))
        last_add[0] = loop.time()
        await asyncio.sleep(0.03)
    steady = list(sent)
    assert 4 <= len(steady) <= 8, steady
    for left, came in steady:
        assert left - came < 0.005, (left, came)  # on the event's own wake-up
    for (a, _), (b, _) in zip(steady, steady[1:], strict=False):
        assert b - a >= interval - 0.001
    # one more event, then nothing: it still leaves, within two intervals of the last send
    await asyncio.sleep(0.05)
    pub.add(_stored(21, h[21]))
    await asyncio.sleep(2.5 * interval)
    assert len(sent) == len(steady) + 1
    assert sent[-1][0] - sent[-2][0] <= 2 * interval + 0.02
    task.cancel()
    await pub.close()
