"""worker/heap.py: the start-up heap leaves the collector's walk; pauses are timed."""

from __future__ import annotations

import gc
import weakref
from collections.abc import Iterator

import pytest

from worker.heap import freeze_startup_heap, gc_pauses, space_full_collections


class _Node:
    def __init__(self) -> None:
        self.me = self  # a cycle: only the collector can free it


@pytest.fixture(autouse=True)
def _thaw() -> Iterator[None]:
    thresholds = gc.get_threshold()
    yield
    gc.unfreeze()  # the rest of the test process collects as before
    gc.set_threshold(*thresholds)


def _tracked(obj: object) -> bool:
    return any(o is obj for o in gc.get_objects())


def test_objects_alive_at_the_freeze_leave_the_collectors_walk_and_later_ones_do_not() -> None:
    before = [[i] for i in range(1000)]  # lists: always tracked
    assert _tracked(before[0])
    frozen = freeze_startup_heap()
    assert frozen >= 1000
    assert not _tracked(before[0])  # no generation, hence no collection, visits it
    after = [-1]
    assert _tracked(after)


def test_a_second_freeze_collects_the_cyclic_garbage_the_first_one_kept() -> None:
    node = _Node()
    freeze_startup_heap()
    gone: list[bool] = []
    ref = weakref.ref(node, lambda _: gone.append(True))
    del node
    gc.collect()
    assert ref() is not None  # frozen garbage is never collected...
    freeze_startup_heap()  # ...until the next freeze thaws it first (a role change)
    assert ref() is None and gone == [True]


def test_pauses_count_full_collections_and_keep_the_longest_until_taken() -> None:
    p = gc_pauses()
    assert gc_pauses() is p  # one callback per process
    full = p.full
    gc.collect()
    assert p.full == full + 1
    assert p.max_s > 0.0
    longest = p.take_max()
    assert longest > 0.0 and p.max_s == 0.0
    assert gc.callbacks.count(p._on_gc) == 1


def _full_collections_while_growing(n: int) -> int:
    """Full collections while n live containers pile up, as a burst of requests' state does."""
    full: list[int] = []

    def on_gc(phase: str, info: dict[str, int]) -> None:
        if phase == "start" and info.get("generation") == 2:
            full.append(1)

    gc.callbacks.append(on_gc)
    try:
        live = [[i] for i in range(n)]
    finally:
        gc.callbacks.remove(on_gc)
    del live
    return len(full)


def test_spaced_full_collections_come_a_tenth_as_often_under_a_burst() -> None:
    freeze_startup_heap()
    gen0, gen1, _ = gc.get_threshold()
    gc.set_threshold(gen0, gen1, 10)  # CPython's default
    by_default = _full_collections_while_growing(400_000)
    freeze_startup_heap()
    space_full_collections()
    assert gc.get_threshold() == (gen0, gen1, 100)  # the young generations as they were
    spaced = _full_collections_while_growing(400_000)
    assert by_default >= 2  # the default walks the growing live state again and again
    assert spaced < by_default / 2


def test_spacing_must_be_positive() -> None:
    with pytest.raises(ValueError, match="every must be >= 1, got 0"):
        space_full_collections(0)
