"""Length-prefixed pickled frames over a pipe between rank 0 and a follower it spawned
(a private channel between two processes of one engine, never a network socket)."""

from __future__ import annotations

import os
import pickle
import struct
from typing import Any

_LEN = struct.Struct("<Q")


def write_frame(fd: int, obj: Any) -> None:
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    buf = memoryview(_LEN.pack(len(data)) + data)
    while buf:
        n = os.write(fd, buf)
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
