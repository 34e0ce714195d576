"""The serving processes' garbage collector: the start-up heap frozen, collection pauses timed.

Why: CPython's full (oldest-generation) collection walks every tracked container in the
process. An engine process holds ~300k of them once torch, Triton and the model are loaded,
and the router, the bench client and the workers' gRPC processes tens of thousands from
their imports: one full collection is then 50-200 ms, and every request of every stream
waits for it (measured on the H200: inter-token gaps of 100-200 ms at c=512, late in long
outputs, when enough allocations had accumulated to trigger one). Those objects live as
long as the process, so collecting them is wasted work: ``gc.freeze()`` moves them to a
generation no collection visits, leaving collections only what was built while serving.

What is left for a full collection to walk while serving is the live state of the requests
in flight (the router's cycles are gone: tests/router/test_run_no_cycles.py), and a burst
of new requests is what makes CPython start one: its default, one full collection per 10
generation-1 collections, came up every few hundred requests, so the router paused every
stream for 21-30 ms on a 2-core VM (15 ms on an H200 host) as the seeds' 1,024-token
prompts arrived. ``space_full_collections`` makes it one per 100 in the processes that
were measured (the router and its frontends, the workers' gRPC processes;
bench/RESULTS.md, "The router's full collections under a burst"): the same walk, a tenth as
often, and cyclic garbage that reaches the oldest generation waits longer for it.
"""

from __future__ import annotations

import gc
import time


def freeze_startup_heap() -> int:
    """Collect once, then exempt everything alive from later collections; returns how many
    objects were frozen. Call when a process has finished starting (model loaded, server
    bound). Calling again (a worker changing role) first thaws the earlier freeze, so what
    the old role left as cyclic garbage is collected rather than kept for good."""
    gc.unfreeze()
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


# one full collection per this many generation-1 collections while serving (CPython's: 10)
SERVING_FULL_EVERY = 100


def space_full_collections(every: int = SERVING_FULL_EVERY) -> None:
    """Full collections only after ``every`` generation-1 collections; the young
    generations' thresholds stay as they are."""
    if every < 1:
        raise ValueError(f"every must be >= 1, got {every}")
    gen0, gen1, _ = gc.get_threshold()
    gc.set_threshold(gen0, gen1, every)


class GcPauses:
    """Times this process's collections (``gc.callbacks``): how many full ones ran and the
    longest pause, so a step-time log can show whether a slow window was the collector."""

    def __init__(self) -> None:
        self._clock = time.perf_counter
        self._started = 0.0
        self.full = 0  # oldest-generation collections
        self.total_s = 0.0  # every collection's pause, all generations
        self.max_s = 0.0  # the longest since the last take_max()

    def take_max(self) -> float:
        """The longest pause since the last call, in seconds; resets it."""
        m, self.max_s = self.max_s, 0.0
        return m

    def _on_gc(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._started = self._clock()
            return
        pause = self._clock() - self._started
        self.total_s += pause
        self.max_s = max(self.max_s, pause)
        if info.get("generation") == 2:
            self.full += 1


_PAUSES: GcPauses | None = None


def gc_pauses() -> GcPauses:
    """The process's one timer, installed on first use (a callback per caller would time
    every collection again for each)."""
    global _PAUSES
    if _PAUSES is None:
        _PAUSES = GcPauses()
        gc.callbacks.append(_PAUSES._on_gc)
    return _PAUSES
