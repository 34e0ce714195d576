"""The gRPC process's copy of which prefix-cache blocks its engine holds, kept from the
engine's KV events (worker/kv_forward.py), so that a router asking for a resync gets a
snapshot at once, without a round trip through the engine process.

Bounded by the engine: it never holds more hashes than the engine's pool has blocks (a
block is stored once and removed before it is reused).
"""

from __future__ import annotations

from worker.messages import KVEventsEvent, KVSnapshotEvent


class KVMirror:
    def __init__(self) -> None:
        self.seq = 0  # the newest event applied (0: none)
        self._held: dict[bytes, None] = {}  # insertion-ordered: oldest first

    def __len__(self) -> int:
        return len(self._held)

    def __contains__(self, h: bytes) -> bool:
        return h in self._held

    def apply(self, ev: KVEventsEvent) -> None:
        for item in ev.items:
            if item.removed:
                for h in item.hashes:
                    self._held.pop(h, None)
            else:
                for h in item.hashes:
                    self._held[h] = None
            self.seq = item.seq

    def replace(self, snap: KVSnapshotEvent) -> None:
        self._held = dict.fromkeys(snap.hashes)
        self.seq = snap.seq

    def snapshot(self, limit: int) -> list[bytes]:
        """The newest ``limit`` hashes held, oldest first (the router's view is a hint:
        what it misses costs compute, never a token)."""
        hs = list(self._held)
        return hs[-limit:] if len(hs) > limit else hs
