"""Length-prefixed frames over a pipe between rank 0 and a follower it spawned (a private
channel between two processes of one engine, never a network socket); each frame is one
message of ``engine.parallel.messages``, checked on the way in."""

from __future__ import annotations

import os
import select
import struct
import time
from typing import Any

from engine.codec import Codec
from engine.parallel.messages import FROM_FOLLOWER, TO_FOLLOWER

_LEN = struct.Struct("<Q")


_CODECS: dict[type, Codec] = {**{c: TO_FOLLOWER for c in TO_FOLLOWER.by_class},
                              **{c: FROM_FOLLOWER for c in FROM_FOLLOWER.by_class}}


def write_frame(fd: int, msg: Any, timeout_s: float | None = None) -> None:
    """timeout_s: on a non-blocking fd, TimeoutError when the reader takes no bytes for
    that long (a hung reader must not hang the writer when the pipe is full)."""
    data = _CODECS[type(msg)].encode(msg)
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


def read_frame(fd: int, codec: Codec) -> Any:
    """The next message of ``codec``'s direction (TO_FOLLOWER on a follower, FROM_FOLLOWER
    on rank 0); EOFError when the writer is gone, MessageError for a malformed one."""
    (n,) = _LEN.unpack(_read_exact(fd, _LEN.size))
    return codec.decode(_read_exact(fd, n))


def _read_exact(fd: int, n: int) -> bytes:
    parts = []
    while n:
        chunk = os.read(fd, min(n, 1 << 20))
        if not chunk:
            raise EOFError("tensor parallel: peer closed the channel")
        parts.append(chunk)
        n -= len(chunk)
    return b"".join(parts)
