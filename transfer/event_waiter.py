"""Waits for CUDA events off the I/O thread and wakes the loop when each one completes.

Why a thread: the I/O loop polls its sockets with a millisecond timeout, so testing an
event once per turn adds up to a millisecond per step (a 64 MiB run between H200s takes
0.2 ms). ``Event.synchronize`` releases the GIL while it blocks, so the waiter costs the
engine's Python thread nothing; events on one stream complete in order, so one FIFO
waiter per stream is exact.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from typing import Any


class EventWaiter:
    def __init__(self, wake: Callable[[], None], name: str) -> None:
        self._wake = wake
        self._q: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def add(self, event: Any) -> None:
        """``event``: a recorded torch.cuda.Event; the loop is woken once it completed."""
        self._q.put(event)

    def close(self, timeout: float = 10.0) -> None:
        self._q.put(None)
        self._thread.join(timeout)

    def _run(self) -> None:
        while (event := self._q.get()) is not None:
            try:
                event.synchronize()
            finally:  # a failed wait still wakes the loop: its query() then reports it
                self._wake()
