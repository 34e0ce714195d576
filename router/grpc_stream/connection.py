"""One client connection of the hand-framed gRPC door: h2's events turned into calls.

h2 parses every frame and keeps the connection's state: the preface, SETTINGS (and their
acks), PING acks, HPACK decoding of the request's headers (dynamic table and Huffman),
the request's DATA and its WINDOW_UPDATEs, RST_STREAM, GOAWAY, and the peer's windows,
which ``StreamCall`` charges for the frames it writes by hand. Whatever h2 takes for a
protocol error (junk bytes, a bad preface, a malformed frame) ends this connection with
GOAWAY and nothing else: its calls are cancelled as if the client left, the listener and
every other connection go on.

A request is checked as grpc's server checks it, in order: the method (only
``pdserve.v1.Router/Generate`` is served here: UNIMPLEMENTED), ``content-type``,
``grpc-encoding`` (identity only: UNIMPLEMENTED), the API key (UNAUTHENTICATED),
``grpc-timeout``, the message's size (``max_receive`` bytes: RESOURCE_EXHAUSTED), its
prefix (not compressed) and its protobuf; then the door's handler serves it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Coroutine
from typing import Any, Protocol

import grpc
import h2.config
import h2.connection
import h2.events
import h2.exceptions
import h2.settings
from h2.errors import ErrorCodes
from pdserve.v1 import router_pb2

from router.auth import UNAUTHENTICATED_MESSAGE, bearer_ok
from router.grpc_stream.call import StreamCall
from router.grpc_stream.status import GENERATE_PATH, parse_timeout

log = logging.getLogger(__name__)

# Ours, sent in the first SETTINGS: streams one connection may have open, and request-side
# windows large enough that a request's message rarely waits for a WINDOW_UPDATE.
MAX_CONCURRENT_STREAMS = 4096
RECEIVE_WINDOW = 1 << 20
MAX_HEADER_LIST_SIZE = 16384  # a request's headers, decoded (grpc's default is 8 KiB)


class Door(Protocol):
    """What a connection needs of its listener (``GrpcStreamDoor``)."""

    api_key: str
    max_receive: int  # bytes of one request message
    connections: set[GrpcConnection]

    def serve(self, call: StreamCall, request: router_pb2.GenerateRequest
              ) -> Coroutine[Any, Any, None]: ...


class GrpcConnection(asyncio.Protocol):
    def __init__(self, door: Door) -> None:
        self.door = door
        self.h2 = h2.connection.H2Connection(h2.config.H2Configuration(
            client_side=False, header_encoding="utf-8"))
        self.h2.local_settings = h2.settings.Settings(client=False, initial_values={
            h2.settings.SettingCodes.MAX_CONCURRENT_STREAMS: MAX_CONCURRENT_STREAMS,
            h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: RECEIVE_WINDOW,
            h2.settings.SettingCodes.MAX_HEADER_LIST_SIZE: MAX_HEADER_LIST_SIZE})
        self.transport: Any = None  # uvloop's transports are no asyncio.Transport subclass
        self.calls: dict[int, StreamCall] = {}
        self.waiting: set[StreamCall] = set()  # calls with bytes waiting for the windows
        self.paused = False  # the transport's buffer is past its high mark
        self.draining = False  # GOAWAY sent: no new streams
        self.closed = False

    # -- asyncio.Protocol ------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport
        self.h2.initiate_connection()
        self.h2.increment_flow_control_window(RECEIVE_WINDOW - 65535)  # the connection's
        self.flush()
        self.door.connections.add(self)

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        for call in list(self.calls.values()):
            call.gone("the connection closed")
        self.door.connections.discard(self)

    def pause_writing(self) -> None:
        self.paused = True

    def resume_writing(self) -> None:
        self.paused = False
        self._pump_all()

    def data_received(self, data: bytes) -> None:
        try:
            events = self.h2.receive_data(data)
        except h2.exceptions.ProtocolError as e:
            self.abort(f"HTTP/2 protocol error: {e}", _error_code(e))
            return
        for ev in events:
            try:
                self._event(ev)
            except h2.exceptions.ProtocolError as e:
                self.abort(f"HTTP/2 protocol error: {e}", _error_code(e))
                return
        self.flush()
        if self.waiting:
            self._pump_all()

    # -- the door's side -------------------------------------------------------------------

    def flush(self) -> None:
        data = self.h2.data_to_send()
        if data and not self.closed:
            self.transport.write(data)

    def pump(self, call: StreamCall) -> None:
        """Sends what the windows take of ``call``'s queued bytes; the rest waits for a
        WINDOW_UPDATE or, with the transport paused, for ``resume_writing``."""
        if not (self.paused or self.closed):
            frames = call.send_pending()
            if frames:
                self.transport.write(frames)
        if call.pending:
            self.waiting.add(call)

    def ended(self, call: StreamCall) -> None:
        self.calls.pop(call.sid, None)
        self.waiting.discard(call)
        if self.draining and not self.calls:
            self.close()

    def goaway(self) -> None:
        """Shutdown's first step: GOAWAY naming the last stream taken, so the client opens no
        more here; the open streams go on to their end (then the connection closes).

        Written by hand: h2 counts a GOAWAY it sends as the connection's end and would send
        nothing more, not even the open streams' trailers."""
        if self.draining or self.closed:
            return
        self.draining = True
        # 8 bytes of payload, type GOAWAY (7), no flags, stream 0; last stream id, NO_ERROR
        last = self.h2.highest_inbound_stream_id or 0
        self.transport.write(b"\x00\x00\x08\x07\x00\x00\x00\x00\x00" + last.to_bytes(4, "big")
                             + int(ErrorCodes.NO_ERROR).to_bytes(4, "big"))
        if not self.calls:
            self.close()

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.transport.close()

    def abort(self, why: str, code: ErrorCodes = ErrorCodes.PROTOCOL_ERROR) -> None:
        """Ends this connection only: GOAWAY with ``code``, its calls cancelled."""
        log.info("gRPC stream door: closing a connection from %s: %s",
                 self.transport.get_extra_info("peername"), why)
        try:
            self.h2.close_connection(error_code=code)
            self.flush()
        except Exception:  # noqa: BLE001 - a state h2 cannot send GOAWAY from
            pass
        for call in list(self.calls.values()):
            call.gone(why)
        self.close()

    # -- h2's events -----------------------------------------------------------------------

    def _event(self, ev: h2.events.Event) -> None:
        if isinstance(ev, h2.events.DataReceived):
            self._data(ev)
        elif isinstance(ev, h2.events.RequestReceived):
            self._request(ev)
        elif isinstance(ev, h2.events.StreamEnded):
            call = self.calls.get(ev.stream_id)
            if call is not None:
                call.request_ended = True
                self._start(call)
        elif isinstance(ev, h2.events.StreamReset):
            call = self.calls.get(ev.stream_id)
            if call is not None:
                call.gone("the client reset the stream")
        elif isinstance(ev, (h2.events.WindowUpdated, h2.events.RemoteSettingsChanged)):
            self._pump_all()
        # PINGs are acked and SETTINGS applied by h2 itself; a client's GOAWAY leaves the
        # open streams to finish.

    def _request(self, ev: h2.events.RequestReceived) -> None:
        sid = ev.stream_id
        if self.draining:
            self.h2.reset_stream(sid, ErrorCodes.REFUSED_STREAM)
            return
        call = StreamCall(self, sid)
        self.calls[sid] = call
        call.received_ns = time.time_ns()
        # str names and values: the connection decodes them (header_encoding)
        headers: dict[str, str] = {str(k): str(v) for k, v in ev.headers or ()}
        door = self.door
        path = headers.get(":path", "")
        if headers.get(":method") != "POST" or path != GENERATE_PATH:
            call.finish(grpc.StatusCode.UNIMPLEMENTED,
                        f"Method not found: {path} (this port serves {GENERATE_PATH} only)")
            return
        ctype = headers.get("content-type", "")
        if not ctype.startswith("application/grpc"):
            call.finish(grpc.StatusCode.INTERNAL,
                        f"content-type: must be application/grpc, got {ctype!r}")
            return
        enc = headers.get("grpc-encoding", "identity")
        if enc != "identity":
            call.finish(grpc.StatusCode.UNIMPLEMENTED,
                        f"grpc-encoding: only identity is served, got {enc!r}")
            return
        if not bearer_ok(headers.get("authorization"), door.api_key):
            call.finish(grpc.StatusCode.UNAUTHENTICATED, UNAUTHENTICATED_MESSAGE)
            return
        if (timeout := headers.get("grpc-timeout")) is not None:
            try:
                seconds = parse_timeout(timeout)
            except ValueError as e:
                call.finish(grpc.StatusCode.INTERNAL, str(e))
                return
            call.deadline = asyncio.get_running_loop().call_later(seconds, call.expire)

    def _data(self, ev: h2.events.DataReceived) -> None:
        sid = ev.stream_id
        # the request's bytes are taken as they come: open the windows again at once
        try:
            self.h2.acknowledge_received_data(ev.flow_controlled_length, sid)
        except h2.exceptions.StreamClosedError:
            self.h2.increment_flow_control_window(ev.flow_controlled_length)
        call = self.calls.get(sid)
        if call is None or call.ended:
            return
        call.body += ev.data
        limit = self.door.max_receive
        if len(call.body) >= 5:
            size = int.from_bytes(call.body[1:5], "big")
            if size > limit:
                call.finish(grpc.StatusCode.RESOURCE_EXHAUSTED,
                            f"Received message larger than max ({size} vs. {limit})")

    def _start(self, call: StreamCall) -> None:
        if call.ended:
            return
        body = call.body
        if len(body) < 5:
            call.finish(grpc.StatusCode.INTERNAL, "request: no message")
            return
        size = int.from_bytes(body[1:5], "big")
        if body[0] != 0:
            call.finish(grpc.StatusCode.INTERNAL,
                        "request: a compressed message without grpc-encoding")
            return
        if len(body) != 5 + size:
            call.finish(grpc.StatusCode.INTERNAL,
                        "request: one message of the length its prefix gives expected, got "
                        f"{len(body) - 5} bytes for {size}")
            return
        try:
            req = router_pb2.GenerateRequest.FromString(bytes(body[5:]))
        except Exception:  # noqa: BLE001 - protobuf's DecodeError and friends
            call.finish(grpc.StatusCode.INTERNAL,
                        "request: not a pdserve.v1.GenerateRequest message")
            return
        call.body = bytearray()
        call.task = asyncio.get_running_loop().create_task(self.door.serve(call, req))

    def _pump_all(self) -> None:
        if self.paused or self.closed or not self.waiting:
            return
        out = []
        for c in list(self.waiting):
            out.append(c.send_pending())
            if not c.pending:
                self.waiting.discard(c)
        data = b"".join(out)
        if data:
            self.transport.write(data)


def _error_code(e: Exception) -> ErrorCodes:
    code = getattr(e, "error_code", None)
    return code if isinstance(code, ErrorCodes) else ErrorCodes.PROTOCOL_ERROR
