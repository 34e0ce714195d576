"""A minimal HTTP/2 client connection for gRPC server-streaming calls, framed by hand: the
bench's load generator for the router's gRPC doors.

Why: grpcio's asyncio client spends 35-57 µs of CPU per streamed token (bench/RESULTS.md,
the simulated-engine runs on a 16-core host), more than the router it measures, so a
scale-out measurement ran out of cores for the clients before the frontends. Here a DATA
frame costs one header unpack and a slice per gRPC message; HPACK (the ``hpack`` library)
runs only on header blocks, twice per call.

What it speaks: cleartext HTTP/2 with prior knowledge (the router's gRPC ports), calls that
send one request message and read a response stream. The peer's SETTINGS are applied and
acknowledged, PINGs answered; GOAWAY fails the calls it names and ends new ones, RST_STREAM
fails its call, a closed or broken connection fails every call. Flow control: our receive
windows open wide at the start (each stream's through SETTINGS_INITIAL_WINDOW_SIZE, the
connection's by WINDOW_UPDATE) and the connection's is topped up as data arrives; a request
message waits for the peer's send windows like any HTTP/2 sender. The peer's
MAX_CONCURRENT_STREAMS is honoured: a call waits for a free stream.
"""

from __future__ import annotations

import asyncio
import struct
from collections.abc import Callable, Sequence
from urllib.parse import unquote

import hpack

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
DATA, HEADERS, RST_STREAM, SETTINGS, PUSH_PROMISE, PING, GOAWAY, WINDOW_UPDATE, \
    CONTINUATION = 0x0, 0x1, 0x3, 0x4, 0x5, 0x6, 0x7, 0x8, 0x9
END_STREAM = ACK = 0x1
END_HEADERS, PADDED, PRIORITY_FLAG = 0x4, 0x8, 0x20
SETTINGS_MAX_CONCURRENT_STREAMS, SETTINGS_INITIAL_WINDOW_SIZE, SETTINGS_MAX_FRAME_SIZE = \
    0x3, 0x4, 0x5
CANCEL = 0x8
MAX_WINDOW = (1 << 31) - 1
DEFAULT_WINDOW = 65_535
TOP_UP = 1 << 30  # received bytes after which the connection window is reopened
_HEAD = struct.Struct(">I")  # a frame header's first 4 bytes: 24-bit length + type


class CallEnded(Exception):
    """A call ended without a gRPC status from the server (reset, GOAWAY, connection
    lost); ``code`` names it as grpc would (UNAVAILABLE, CANCELLED, ...)."""

    def __init__(self, code: str, details: str) -> None:
        super().__init__(f"{code}: {details}")
        self.code, self.details = code, details


class H2Call:
    """One call's receiving side: gRPC messages as they complete, then its status."""

    def __init__(self, stream_id: int, on_message: Callable[[bytes], None]) -> None:
        self.stream_id = stream_id
        self.on_message = on_message
        self.buf = bytearray()  # DATA bytes not yet a whole gRPC message
        self.header_block = bytearray()  # a HEADERS block awaiting its CONTINUATIONs
        self.headers: dict[str, str] = {}  # response headers and trailers, merged
        self.done: asyncio.Future[tuple[int, str]] = \
            asyncio.get_running_loop().create_future()  # (grpc-status, grpc-message)
        self.send_window = 0

    def data(self, payload: memoryview) -> None:
        buf = self.buf
        buf += payload
        while len(buf) >= 5:
            n = int.from_bytes(buf[1:5], "big")
            if len(buf) < 5 + n:
                return
            if buf[0]:
                raise CallEnded("INTERNAL", "compressed response message")
            msg = bytes(buf[5:5 + n])
            del buf[:5 + n]
            self.on_message(msg)

    def ended(self) -> None:
        if self.done.done():
            return
        status = self.headers.get("grpc-status")
        if status is None:
            self.done.set_exception(CallEnded(
                "UNKNOWN", f"stream ended without grpc-status (HTTP "
                           f"{self.headers.get(':status', '?')})"))
        else:
            self.done.set_result((int(status), unquote(self.headers.get("grpc-message", ""))))

    def fail(self, e: CallEnded) -> None:
        if not self.done.done():
            self.done.set_exception(e)


class H2Connection(asyncio.Protocol):
    def __init__(self, authority: str) -> None:
        self.authority = authority
        self.transport: asyncio.Transport | None = None
        self.calls: dict[int, H2Call] = {}
        self.next_id = 1
        self.encoder = hpack.Encoder()
        self.decoder = hpack.Decoder()
        self.buf = bytearray()
        self.peer_max_streams = 1 << 31
        self.peer_initial_window = DEFAULT_WINDOW
        self.peer_max_frame = 16_384
        self.send_window = DEFAULT_WINDOW  # the connection's, for our DATA
        self.received = 0  # DATA bytes since our last connection WINDOW_UPDATE
        self.closed: CallEnded | None = None
        self.window_open = asyncio.Event()  # a WINDOW_UPDATE or SETTINGS came: retry sends
        self.stream_freed = asyncio.Event()
        self._continuing: H2Call | None = None  # a header block continues on this call
        self._ending = False  # that block's HEADERS frame had END_STREAM

    # ---- asyncio.Protocol ------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        settings = struct.pack(">HI", SETTINGS_INITIAL_WINDOW_SIZE, MAX_WINDOW)
        transport.write(PREFACE + _frame(SETTINGS, 0, 0, settings)
                        + _frame(WINDOW_UPDATE, 0, 0,
                                 struct.pack(">I", MAX_WINDOW - DEFAULT_WINDOW)))

    def connection_lost(self, exc: Exception | None) -> None:
        self._close(CallEnded("UNAVAILABLE", f"connection closed ({exc or 'by the peer'})"))

    def data_received(self, data: bytes) -> None:
        if self.buf:  # a frame cut by the last chunk: joined once, then parsed as bytes
            data = bytes(self.buf) + data
            self.buf.clear()
        # A view of an immutable bytes: the payload slices handed on may outlive this call
        # (an exception's traceback keeps them) without pinning a buffer we resize.
        view = memoryview(data)
        at, end = 0, len(data)
        try:
            while end - at >= 9:
                head = _HEAD.unpack_from(view, at)[0]
                length, kind = head >> 8, head & 0xFF
                if end - at < 9 + length:
                    break
                flags = view[at + 4]
                sid = _HEAD.unpack_from(view, at + 5)[0] & 0x7FFFFFFF
                self._frame(kind, flags, sid, view[at + 9:at + 9 + length])
                at += 9 + length
        except CallEnded as e:  # the peer broke the protocol: nothing on it can go on
            self._close(e)
            if self.transport is not None:
                self.transport.close()
            return
        self.buf += view[at:]

    # ---- frames ----------------------------------------------------------------------
    def _frame(self, kind: int, flags: int, sid: int, payload: memoryview) -> None:
        if self._continuing is not None and kind != CONTINUATION:
            raise CallEnded("INTERNAL", "a header block was interrupted")
        if kind == DATA:
            self.received += len(payload)
            if self.received >= TOP_UP:
                self._write(_frame(WINDOW_UPDATE, 0, 0, struct.pack(">I", self.received)))
                self.received = 0
            call = self.calls.get(sid)
            if call is None:
                return  # a call we reset or finished: its late frames are dropped
            if flags & PADDED:
                payload = payload[1:len(payload) - payload[0]]
            try:
                call.data(payload)
            except CallEnded as e:
                self._reset(call, e)
                return
            if flags & END_STREAM:
                self._end(call)
        elif kind in (HEADERS, CONTINUATION):
            call = self.calls.get(sid) if kind == HEADERS else self._continuing
            if kind == HEADERS:
                if flags & PADDED:
                    payload = payload[1:len(payload) - payload[0]]
                if flags & PRIORITY_FLAG:
                    payload = payload[5:]
                self._ending = bool(flags & END_STREAM)
                block = bytearray(payload)
            else:
                if call is None:
                    raise CallEnded("INTERNAL", "CONTINUATION without HEADERS")
                block = call.header_block + payload
            if call is None:  # headers of a call already gone: decoded all the same
                call = H2Call(sid, lambda _m: None)  # (HPACK's table is per connection)
            if not flags & END_HEADERS:
                call.header_block = block
                self._continuing = call
                return
            self._continuing = None
            call.header_block = bytearray()
            try:
                headers = self.decoder.decode(bytes(block))
            except hpack.HPACKError as e:
                raise CallEnded("INTERNAL", f"bad header block: {e}") from None
            call.headers.update((str(k), str(v)) for k, v in headers)
            if self._ending and sid in self.calls:
                self._end(call)
        elif kind == SETTINGS:
            if not flags & ACK:
                self._settings(payload)
                self._write(_frame(SETTINGS, ACK, 0, b""))
        elif kind == PING:
            if not flags & ACK:
                self._write(_frame(PING, ACK, 0, bytes(payload)))
        elif kind == WINDOW_UPDATE:
            inc = _HEAD.unpack_from(payload, 0)[0] & 0x7FFFFFFF
            if sid == 0:
                self.send_window += inc
            elif (call := self.calls.get(sid)) is not None:
                call.send_window += inc
            self.window_open.set()
        elif kind == RST_STREAM:
            if (call := self.calls.pop(sid, None)) is not None:
                code = _HEAD.unpack_from(payload, 0)[0]
                call.fail(CallEnded("CANCELLED" if code == CANCEL else "UNAVAILABLE",
                                    f"stream reset by the peer (HTTP/2 error {code})"))
                self.stream_freed.set()
        elif kind == GOAWAY:
            last = _HEAD.unpack_from(payload, 0)[0] & 0x7FFFFFFF
            away = CallEnded("UNAVAILABLE", "the server is going away (GOAWAY)")
            for s in [s for s in self.calls if s > last]:
                self.calls.pop(s).fail(away)
            self.closed = self.closed or away
            self.stream_freed.set()
        elif kind == PUSH_PROMISE:
            raise CallEnded("INTERNAL", "PUSH_PROMISE, which a client never enables")

    def _settings(self, payload: memoryview) -> None:
        for off in range(0, len(payload) - len(payload) % 6, 6):
            key, value = struct.unpack_from(">HI", payload, off)
            if key == SETTINGS_MAX_CONCURRENT_STREAMS:
                self.peer_max_streams = value
                self.stream_freed.set()
            elif key == SETTINGS_INITIAL_WINDOW_SIZE:
                for call in self.calls.values():
                    call.send_window += value - self.peer_initial_window
                self.peer_initial_window = value
                self.window_open.set()
            elif key == SETTINGS_MAX_FRAME_SIZE:
                self.peer_max_frame = value

    def _end(self, call: H2Call) -> None:
        self.calls.pop(call.stream_id, None)
        call.ended()
        self.stream_freed.set()

    def _reset(self, call: H2Call, e: CallEnded) -> None:
        self.calls.pop(call.stream_id, None)
        self._write(_frame(RST_STREAM, 0, call.stream_id, struct.pack(">I", CANCEL)))
        call.fail(e)
        self.stream_freed.set()

    def _close(self, e: CallEnded) -> None:
        self.closed = self.closed or e
        for call in self.calls.values():
            call.fail(e)
        self.calls.clear()
        self.stream_freed.set()
        self.window_open.set()

    def _write(self, data: bytes) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self.transport.write(data)

    # ---- calls -----------------------------------------------------------------------
    async def call(self, path: str, message: bytes, metadata: Sequence[tuple[str, str]],
                   on_message: Callable[[bytes], None]) -> H2Call:
        """Starts a call: headers, then ``message`` as its only request message. Each whole
        response message goes to ``on_message`` as it lands; await ``done`` for the end."""
        while self.closed is None and len(self.calls) >= self.peer_max_streams:
            self.stream_freed.clear()
            await self.stream_freed.wait()
        if self.closed is not None:
            raise self.closed
        sid = self.next_id
        self.next_id += 2
        call = H2Call(sid, on_message)
        call.send_window = self.peer_initial_window
        self.calls[sid] = call
        headers = [(":method", "POST"), (":scheme", "http"), (":path", path),
                   (":authority", self.authority), ("content-type", "application/grpc"),
                   ("te", "trailers"), *metadata]
        self._write(_frame(HEADERS, END_HEADERS, sid, self.encoder.encode(headers)))
        body = memoryview(b"\0" + len(message).to_bytes(4, "big") + message)
        while body:
            room = min(self.send_window, call.send_window, self.peer_max_frame)
            if room <= 0:
                self.window_open.clear()
                await self.window_open.wait()
                if call.done.done():  # failed while it waited
                    return call
                continue
            part, body = body[:room], body[room:]
            self.send_window -= len(part)
            call.send_window -= len(part)
            self._write(_frame(DATA, 0 if body else END_STREAM, sid, bytes(part)))
        return call

    def cancel(self, call: H2Call, why: str) -> None:
        """Resets a call still open (the client gave up on it)."""
        if self.calls.get(call.stream_id) is call:
            self._reset(call, CallEnded("DEADLINE_EXCEEDED", why))

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()


def _frame(kind: int, flags: int, sid: int, payload: bytes) -> bytes:
    return (len(payload).to_bytes(3, "big") + bytes((kind, flags))
            + sid.to_bytes(4, "big") + payload)
