"""The engine process's side of the KV events: after each loop turn, the prefix cache's new
events go to the gRPC process in one message (it mirrors them and publishes them to the
router, worker/kv_publisher.py).

The engine's event queue is bounded and drops its oldest events when nobody drains it; the
gap shows in ``seq``. Then the events after the gap describe changes to a state the reader
never saw, so this sends a snapshot of everything cached instead: its ``seq`` is the last
event's, and the events that follow continue from it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from engine.prefix_cache import BlocksRemoved
from worker.messages import KVBlocksEvent, KVEventsEvent, KVSnapshotEvent
from worker.role import Emit

if TYPE_CHECKING:  # torch loads in the engine process only
    from engine.llm_engine import LLMEngine


class KVEventForwarder:
    def __init__(self, engine: LLMEngine, emit: Emit) -> None:
        self.engine = engine
        self.emit = emit
        self.last_seq = 0  # the newest event (or snapshot) sent
        self.snapshots = 0  # sent after a gap

    def forward(self) -> None:
        events = self.engine.drain_kv_events()
        if not events:
            return
        if events[0].seq != self.last_seq + 1:
            snap = self.engine.kv_cache_snapshot()
            self.emit(KVSnapshotEvent(snap.seq, tuple(h for h, _ in snap.blocks)))
            self.last_seq = snap.seq
            self.snapshots += 1
            return
        self.emit(KVEventsEvent(tuple(
            KVBlocksEvent(e.seq, isinstance(e, BlocksRemoved), e.block_hashes)
            for e in events)))
        self.last_seq = events[-1].seq
