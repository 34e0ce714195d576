"""One ``Generate`` stream on a hand-framed gRPC connection: what ``DirectWrite`` drives.

``write_now`` is the steady state: the response's protobuf bytes, the 5-byte gRPC prefix
and a 9-byte DATA frame header go to the transport as one ``bytes`` when the message fits
the peer's connection and stream windows and one frame, no bytes of this stream wait, and
the transport is not paused; the windows h2 keeps are charged by hand, so h2's view of
them stays true for its own frames. Anything else returns False, and ``DirectWrite`` takes
``write``: the bytes queue on the stream (``pending``) and leave, split at the peer's
MAX_FRAME_SIZE, as WINDOW_UPDATE frames open the windows (``GrpcConnection.pump``); the
write completes once they are all out. While it waits, the request's further tokens queue
in its run and leave merged: HTTP/2 flow control is the slow reader's backpressure, as on
grpc.aio's door.

A stream ends once: trailers (``finish``), or ``gone`` when the peer reset it, its deadline
passed or the connection closed; then its handler is cancelled (the run's teardown aborts
the request on the workers) and any write raises ``StreamGone``.
"""

from __future__ import annotations

import asyncio
from typing import Any, Protocol

import grpc
from h2.errors import ErrorCodes

from router.grpc_stream.status import RESPONSE_HEADERS, prefixed, status_headers


class Connection(Protocol):
    """What a stream needs of its connection (``GrpcConnection``)."""

    h2: Any  # h2.connection.H2Connection
    transport: Any
    paused: bool

    def flush(self) -> None: ...

    def pump(self, call: StreamCall) -> None: ...

    def ended(self, call: StreamCall) -> None: ...


class StreamGone(Exception):
    """The stream ended (reset by the peer, its deadline, the connection closed)."""


class StreamCall:
    def __init__(self, conn: Connection, sid: int) -> None:
        self.conn = conn
        self.sid = sid
        self._sid_bytes = sid.to_bytes(4, "big")
        self._h2s: Any = conn.h2.streams[sid]  # h2's stream: its outbound window is the peer's
        self.headers_sent = False
        self.request_ended = False  # the peer half-closed (its message is complete)
        self.ended = False  # trailers sent, or gone
        self.body = bytearray()  # the request's bytes as they come
        self.pending = bytearray()  # gRPC-framed response bytes waiting for the windows
        self._drained: asyncio.Future[None] | None = None
        self.task: asyncio.Task[None] | None = None
        self.received_ns = 0  # when its HEADERS arrived (the request's metrics)
        self.deadline: asyncio.TimerHandle | None = None

    # -- writes ----------------------------------------------------------------------------

    def write_now(self, resp: Any) -> bool:
        """Writes ``resp`` at once if it fits (see the module's text); False: ``write``."""
        if self.ended:
            raise StreamGone(f"stream {self.sid} ended")
        c = self.conn
        if self.pending or c.paused:
            return False
        msg = resp.SerializeToString()
        n = len(msg) + 5
        h2c, h2s = c.h2, self._h2s
        if (n > h2c.max_outbound_frame_size or n > h2c.outbound_flow_control_window
                or n > h2s.outbound_flow_control_window):
            return False
        if not self.headers_sent:
            self._send_headers()
        h2c.outbound_flow_control_window -= n
        h2s.outbound_flow_control_window -= n
        # frame header: length (24 bits), type DATA (0), no flags, stream id; gRPC prefix
        c.transport.write(n.to_bytes(3, "big") + b"\x00\x00" + self._sid_bytes + b"\x00"
                          + len(msg).to_bytes(4, "big") + msg)
        return True

    async def write(self, resp: Any) -> None:
        """Queues ``resp`` and returns once all of it left (the windows opened)."""
        if self.ended:
            raise StreamGone(f"stream {self.sid} ended")
        if not self.headers_sent:
            self._send_headers()
        self.pending += prefixed(resp.SerializeToString())
        self.conn.pump(self)
        await self.drained()

    async def drained(self) -> None:
        while self.pending and not self.ended:
            self._drained = asyncio.get_running_loop().create_future()
            await self._drained
        if self.ended:
            raise StreamGone(f"stream {self.sid} ended")

    def send_pending(self) -> bytes:
        """The DATA frames of as much of ``pending`` as the windows take now (removed from
        it and charged to them); wakes the writer once nothing waits."""
        h2c, h2s = self.conn.h2, self._h2s
        frames = []
        size = h2c.max_outbound_frame_size
        while self.pending:
            n = min(len(self.pending), size, h2c.outbound_flow_control_window,
                    h2s.outbound_flow_control_window)
            if n <= 0:
                break
            frames.append(n.to_bytes(3, "big") + b"\x00\x00" + self._sid_bytes
                          + bytes(self.pending[:n]))
            del self.pending[:n]
            h2c.outbound_flow_control_window -= n
            h2s.outbound_flow_control_window -= n
        if not self.pending:
            self._wake()
        return b"".join(frames)

    def _wake(self) -> None:
        d, self._drained = self._drained, None
        if d is not None and not d.done():
            d.set_result(None)

    def _send_headers(self) -> None:
        self.headers_sent = True
        self.conn.h2.send_headers(self.sid, RESPONSE_HEADERS)
        self.conn.flush()

    # -- the end ---------------------------------------------------------------------------

    def finish(self, code: grpc.StatusCode, message: str = "",
               extra: tuple[tuple[str, str], ...] = ()) -> None:
        """Ends the call with ``code``: trailers after the response's headers, or one
        Trailers-Only HEADERS frame when nothing was sent. Every message was written (the
        handler waits for its writes); bytes still queued would be lost, so none may be."""
        if self.ended:
            return
        self.ended = True
        self._stop_timer()
        trailers = status_headers(code, message, extra)
        if not self.headers_sent:
            trailers = [*RESPONSE_HEADERS, *trailers]
        h2c = self.conn.h2
        try:
            h2c.send_headers(self.sid, trailers, end_stream=True)
            if not self.request_ended:  # refused before the request's end: stop its upload
                h2c.reset_stream(self.sid, ErrorCodes.NO_ERROR)
        except Exception:  # noqa: BLE001 - the stream or the connection closed meanwhile
            pass
        self.conn.flush()
        self.conn.ended(self)

    def gone(self, why: str) -> None:
        """The peer is gone from this stream: no more writes; the handler is cancelled (the
        run's teardown aborts the request on the workers)."""
        if self.ended:
            return
        self.ended = True
        self._stop_timer()
        self.pending.clear()
        d, self._drained = self._drained, None
        if d is not None and not d.done():
            d.set_exception(StreamGone(why))
            d.exception()  # read here: a handler already cancelled never awaits it
        if self.task is not None:
            self.task.cancel()
        self.conn.ended(self)

    def expire(self) -> None:
        """The client's deadline (``grpc-timeout``) passed: DEADLINE_EXCEEDED, as a grpc
        server ends the call, and the handler is cancelled."""
        self.deadline = None
        if self.ended:
            return
        task = self.task
        self.finish(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded")
        self.pending.clear()
        d, self._drained = self._drained, None
        if d is not None and not d.done():
            d.set_exception(StreamGone("deadline exceeded"))
            d.exception()
        if task is not None:
            task.cancel()

    def _stop_timer(self) -> None:
        if self.deadline is not None:
            self.deadline.cancel()
            self.deadline = None
