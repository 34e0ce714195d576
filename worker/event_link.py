"""The events link, engine process -> gRPC process: one Unix stream socket the engine's own
thread writes and the gRPC process's event loop reads, with no thread between them.

Why not ZMQ, as the commands link: a ZMQ message crosses an I/O thread on each side (the
sender's socket hands it to its I/O thread, which writes; the receiver's I/O thread reads and
signals the socket's descriptor), two thread wake-ups per message on top of the kernel's.
Every engine step's message pays them, and a producer's token 0 waits for them before the
router sees it (the first-token hold). On this project's 2-core VM, one 200-byte message a
millisecond into a uvloop reader (bench/probes/event_link_latency.py, two rounds): ZMQ ipc
124-142 µs p50 and 341-375 µs p99, this link 55-64 µs and 139-245 µs.

A message is the parts ``EventOutbox`` flushes (worker/outbox.py), framed as
``<u32 byte length of the rest><u32 part count><u32 length per part><parts>``. The writer
never waits while the reader keeps up (``EventWriter``). The socket's file sits in its own
0700 directory: only this user reaches it, and the reader takes one connection, its
engine's.
"""

from __future__ import annotations

import asyncio
import collections
import os
import select
import socket
import struct
import tempfile
import time

_U32 = struct.Struct("<I")
# A frame larger than this is a broken writer, not a message (a step's message is KBs; a
# load report of 500 held requests is tens of KB)
MAX_FRAME = 256 << 20
# Bytes read per receive: many steps' messages at once when the reader fell behind
RECV_BYTES = 1 << 20
# Unsent bytes the writer holds before a send waits for the reader. The kernel's buffer
# takes only a few hundred small messages; ZMQ's high-water mark held 10,000 (worker/ipc.py)
MAX_PENDING = 64 << 20


class LinkClosed(Exception):
    """The engine's end closed (it exited), or it sent a frame that is not one."""


class NothingQueued(Exception):
    """No whole message is buffered or readable now (the reader's descriptor signals the
    next arrival)."""


def fresh_path() -> str:
    """A socket path in a new directory only this user can enter."""
    return os.path.join(tempfile.mkdtemp(prefix="pdserve-evt-"), "events.sock")


def frame(parts: list[bytes]) -> bytes:
    head = struct.pack(f"<{len(parts) + 1}I", len(parts), *map(len, parts))
    return b"".join((_U32.pack(len(head) + sum(map(len, parts))), head, *parts))


class EventWriter:
    """The engine process's end: ``send_multipart`` as ZMQ's, one frame per call. It never
    waits for the reader while less than MAX_PENDING bytes are unsent: what the socket does
    not take now waits here, in order, and leaves at the next send or ``flush`` (the engine
    loop flushes at least every turn, idle or not). Past MAX_PENDING the send waits for the
    reader, as ZMQ's high-water mark made it wait: backpressure on an engine whose gRPC
    process stalled."""

    def __init__(self, path: str) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.connect(path)
        self.sock.setblocking(False)
        self._pending: collections.deque[memoryview] = collections.deque()
        self.pending_bytes = 0

    def send_multipart(self, parts: list[bytes]) -> None:
        data = memoryview(frame(parts))
        if not self._pending:
            try:
                sent = self.sock.send(data)
            except BlockingIOError:
                sent = 0
            if sent == len(data):
                return
            data = data[sent:]
        self._pending.append(data)
        self.pending_bytes += len(data)
        self.flush()
        while self.pending_bytes > MAX_PENDING:
            select.select([], [self.sock], [])
            self.flush()

    def flush(self) -> None:
        """Writes what waits here, as far as the socket takes it now."""
        pending = self._pending
        while pending:
            head = pending[0]
            try:
                sent = self.sock.send(head)
            except BlockingIOError:
                return
            self.pending_bytes -= sent
            if sent < len(head):
                pending[0] = head[sent:]
                return
            pending.popleft()

    def close(self, wait_s: float = 1.0) -> None:
        """Sends what waits here (for up to ``wait_s``: the reader may be gone), then
        closes: the reader still gets what was sent."""
        end = time.monotonic() + wait_s
        try:
            while self._pending and (left := end - time.monotonic()) > 0:
                select.select([], [self.sock], [], left)
                self.flush()
        except OSError:
            pass  # the reader is gone: nothing to deliver to
        self.sock.close()


class EventReader:
    """The gRPC process's end: ``accept`` takes the engine's connection (the listener then
    closes: nobody else connects); ``fileno`` is what the event loop watches after it."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._listener: socket.socket | None = socket.socket(socket.AF_UNIX,
                                                             socket.SOCK_STREAM)
        self._listener.bind(path)
        os.chmod(path, 0o600)
        self._listener.listen(1)
        self._listener.setblocking(False)
        self._conn: socket.socket | None = None
        # receives land in one buffer allocated once: recv(RECV_BYTES) allocated and freed a
        # megabyte per receive, several times the cost of the receive itself
        self._landing = memoryview(bytearray(RECV_BYTES))
        self._buf = bytearray()
        self._frames: collections.deque[list[bytes]] = collections.deque()
        self._ended = ""  # why the link ended ("" while open)

    async def accept(self) -> None:
        """Waits for the engine process to connect."""
        assert self._listener is not None, "accept: already connected or closed"
        conn, _ = await asyncio.get_running_loop().sock_accept(self._listener)
        self._take(conn)

    def accept_now(self) -> bool:
        """Takes a connection already waiting, without blocking (a reader outside an event
        loop); True once connected."""
        if self._conn is not None:
            return True
        assert self._listener is not None, "accept_now: closed"
        try:
            conn, _ = self._listener.accept()
        except BlockingIOError:
            return False
        self._take(conn)
        return True

    def _take(self, conn: socket.socket) -> None:
        conn.setblocking(False)
        self._conn = conn
        self._close_listener()

    def fileno(self) -> int:
        if self._conn is None:
            raise LinkClosed(self._ended or "the engine process has not connected")
        return self._conn.fileno()

    def recv_multipart(self) -> list[bytes]:
        """The next message's parts, in the order they were sent. NothingQueued when no
        whole one is here yet; LinkClosed once the link ended and every message before
        that was read."""
        if self._frames:
            return self._frames.popleft()
        if self._ended or self._conn is None:
            raise LinkClosed(self._ended or "the engine process has not connected")
        try:
            got = self._conn.recv_into(self._landing)
        except BlockingIOError:
            raise NothingQueued() from None
        except OSError as e:
            got, self._ended = 0, f"the events link failed: {e}"
        if got:
            self._buf += self._landing[:got]
            self._parse()
        elif not self._ended:
            self._ended = "the engine process closed its end"
        if self._frames:
            return self._frames.popleft()
        if self._ended:
            raise LinkClosed(self._ended)
        raise NothingQueued()

    def _parse(self) -> None:
        """Moves every whole frame in the buffer to the queue; a frame that cannot be one
        ends the link (only the engine process writes here)."""
        buf, pos, n = self._buf, 0, len(self._buf)
        # parts are copied out of a view: one copy each (a bytearray slice is a copy too)
        with memoryview(buf) as view:
            while n - pos >= 4:
                (size,) = _U32.unpack_from(buf, pos)
                if not 4 <= size <= MAX_FRAME:
                    self._ended = f"a frame of {size} bytes: not a message"
                    break
                if n - pos - 4 < size:
                    break
                start = pos + 4
                (count,) = _U32.unpack_from(buf, start)
                if 4 * (count + 1) > size:
                    self._ended = f"a frame of {count} parts in {size} bytes"
                    break
                lengths = struct.unpack_from(f"<{count}I", buf, start + 4)
                at = start + 4 * (count + 1)
                if at + sum(lengths) != start + size:
                    self._ended = "a frame whose parts do not add up to its length"
                    break
                parts = []
                for ln in lengths:
                    parts.append(view[at:at + ln].tobytes())
                    at += ln
                self._frames.append(parts)
                pos = start + size
        if pos:  # the view is released: the buffer may shrink
            del buf[:pos]

    def _close_listener(self) -> None:
        if self._listener is not None:
            self._listener.close()
            self._listener = None
        try:
            os.unlink(self.path)
            os.rmdir(os.path.dirname(self.path))
        except OSError:
            pass

    def close(self) -> None:
        if not self._ended:
            self._ended = "closed"
        if self._conn is not None:
            self._conn.close()
            self._conn = None
        self._close_listener()
