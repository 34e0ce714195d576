"""Length-prefixed pickled frames over a pipe between rank 0 and a follower it spawned
(a private channel between two processes of one engine, never a network socket)."""

from __future__ import annotations

import os
import pickle
import select
import struct
import time
from typing import Any

_LEN = struct.Struct("<Q")


def write_frame(fd: int, obj: Any, timeout_s: float | None = None) -> None:
    """timeout_s: on a non-blocking fd, TimeoutError when the reader takes no bytes for
    that long (a hung reader must not hang the writer when the pipe is full)."""
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    buf = memoryview(_LEN.pack(len(data)) + data)
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    while buf:
        try:
            n = os.write(fd, buf)
        except BlockingIOError:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise TimeoutError("tensor parallel: the peer reads no step plan") from None
            select.select([], [fd], [], left)
            continue
        buf = buf[n:]


def read_frame(fd: int) -> Any:
    """The next object; EOFError when the writer is gone."""
    (n,) = _LEN.unpack(_read_exact(fd, _LEN.size))
    return pickle.loads(_read_exact(fd, n))


def _read_exact(fd: int, n: int) -> bytes:
    parts = []
    while n:
        chunk = os.read(fd, min(n, 1 << 20))
        if not chunk:
            raise EOFError("tensor parallel: peer closed the channel")
        parts.append(chunk)
        n -= len(chunk)
    return b"".join(parts)
