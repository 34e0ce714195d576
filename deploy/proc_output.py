"""A child process's output, kept in a short tail (to name its error when it dies) and shown
on the launcher's terminal only once the cluster is up: start-up noise and tracebacks of a
process that fails to start are summarised in one line instead."""

from __future__ import annotations

import re
import sys
import threading
from collections import deque
from typing import IO

_TRACEBACK_FRAME = re.compile(r"^\s|^Traceback |^During handling|^The above exception")


class ProcOutput:
    def __init__(self, name: str, stream: IO[bytes], sink: IO[bytes] | None = None,
                 echo: threading.Event | None = None) -> None:
        self.name = name
        self._stream = stream
        self._sink = sink  # a log file: everything goes there
        self._echo = echo  # set: lines also go to the launcher's stderr
        self._tail: deque[str] = deque(maxlen=60)
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._pump, name=f"out-{name}", daemon=True)
        self._thread.start()

    def _pump(self) -> None:
        for raw in iter(self._stream.readline, b""):
            line = raw.decode(errors="replace").rstrip("\n")
            with self._lock:
                self._tail.append(line)
            if self._sink is not None:
                self._sink.write(raw)
                self._sink.flush()
            if self._echo is not None and self._echo.is_set():
                print(f"[{self.name}] {line}", file=sys.stderr, flush=True)
        self._stream.close()
        if self._sink is not None:
            self._sink.close()

    def join(self, timeout: float = 5.0) -> None:
        """Waits until everything the process wrote before it exited has been read."""
        self._thread.join(timeout)

    def tail(self) -> list[str]:
        with self._lock:
            return list(self._tail)

    def error_line(self) -> str:
        return error_line(self.tail())


def error_line(lines: list[str]) -> str:
    """The line that says why a process failed: pdserve's own 'error:' line when there is one,
    else a traceback's final exception line, else the last line it wrote."""
    lines = [ln for ln in lines if ln.strip()]
    for ln in reversed(lines):
        if "error: " in ln and not _TRACEBACK_FRAME.match(ln):
            return ln.split("error: ", 1)[1].strip()
    for ln in reversed(lines):
        if not _TRACEBACK_FRAME.match(ln):
            return ln.strip()
    return "(no output)"
