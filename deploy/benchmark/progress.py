"""A one-line progress bar on stderr (no dependency; redrawn at most ~10 times a second)."""

from __future__ import annotations

import sys
import time
from typing import TextIO


class Progress:
    def __init__(self, label: str, total: int, stream: TextIO | None = None,
                 width: int = 30) -> None:
        self.label, self.total, self.width = label, total, width
        self.stream = stream if stream is not None else sys.stderr
        self.done = self.failed = 0
        self._t0 = time.perf_counter()
        self._last = 0.0
        self._tty = self.stream.isatty()

    def update(self, ok: bool) -> None:
        self.done += 1
        self.failed += 0 if ok else 1
        now = time.perf_counter()
        if now - self._last >= 0.1 or self.done == self.total:
            self._last = now
            self._draw(final=self.done == self.total)

    def _draw(self, final: bool) -> None:
        frac = self.done / self.total if self.total else 1.0
        bar = "#" * int(frac * self.width)
        line = (f"{self.label} [{bar:<{self.width}}] {self.done}/{self.total} "
                f"failed {self.failed} {time.perf_counter() - self._t0:.1f}s")
        if self._tty:
            self.stream.write("\r" + line + ("\n" if final else ""))
        elif final:  # logs and pipes get one line per point, not a redraw per request
            self.stream.write(line + "\n")
        self.stream.flush()
