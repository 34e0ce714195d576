"""``bench/grpc_stream_floor.py --mode h2`` / ``h2-coalesce``'s server: gRPC server
streaming with no grpc in the server process. The ``h2`` package does the connection;
each response message is written by hand as one HTTP/2 DATA frame, so the floor bench can
put the cost of a hand-framed message beside grpc.aio's."""

from __future__ import annotations

import asyncio
from typing import Any

from pdserve.v1 import router_pb2


def _varint(n: int) -> bytes:
    out = bytearray()
    while n > 0x7F:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def _field(tag: int, data: bytes) -> bytes:
    return bytes((tag,)) + _varint(len(data)) + data


class H2Stream:
    """One Generate stream of ``H2Door``: its request's id, and the message owed to it while
    the peer's flow-control window is too small."""

    __slots__ = ("sid", "head", "sent", "pending")

    def __init__(self, sid: int, request_id: str) -> None:
        self.sid = sid
        self.head = _field(0x0A, request_id.encode())  # request_id = 1, encoded once
        self.sent = 0
        self.pending: bytes | None = None


class H2Door(asyncio.Protocol):
    """gRPC server streaming with the DATA frames written by hand on an asyncio transport.

    The ``h2`` package does the connection's setup and control (preface, SETTINGS and their
    acks, PINGs, the request's HEADERS and DATA, the response's HEADERS and trailers); each
    response message bypasses it: a 9-byte DATA frame header, the 5-byte gRPC message prefix
    and the message's protobuf bytes (written here, as ``--mode bytes`` does), written to the
    transport as one ``bytes``. The peer's flow-control windows (the connection's and each
    stream's) are kept here from its SETTINGS and WINDOW_UPDATE frames, and a message that
    does not fit waits for the window to open. ``coalesce``: one transport write per tick for
    every stream's message (what one connection carrying many streams allows) instead of
    one write per message (one connection per client)."""

    def __init__(self, door: H2Server) -> None:
        import h2.config
        import h2.connection

        self.server = door
        self.conn = h2.connection.H2Connection(h2.config.H2Configuration(
            client_side=False, header_encoding="utf-8"))
        self.transport: asyncio.Transport | None = None
        self.streams: dict[int, H2Stream] = {}
        self.requests: dict[int, bytearray] = {}
        self.conn_window = 65535  # the peer's connection window, as RFC 9113 starts it
        self.stream_windows: dict[int, int] = {}
        self.initial_window = 65535

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # uvloop's is no subclass
        self.conn.initiate_connection()
        self._flush()
        self.server.doors.append(self)

    def connection_lost(self, exc: Exception | None) -> None:
        if self in self.server.doors:
            self.server.doors.remove(self)

    def _flush(self) -> None:
        data = self.conn.data_to_send()
        if data and self.transport is not None:
            self.transport.write(data)

    def data_received(self, data: bytes) -> None:
        import h2.events

        for ev in self.conn.receive_data(data):
            if isinstance(ev, h2.events.RequestReceived):
                self.requests[ev.stream_id] = bytearray()
                self.stream_windows[ev.stream_id] = self.initial_window
            elif isinstance(ev, h2.events.DataReceived):
                self.requests[ev.stream_id] += ev.data
                self.conn.acknowledge_received_data(ev.flow_controlled_length, ev.stream_id)
            elif isinstance(ev, h2.events.StreamEnded):
                body = bytes(self.requests.pop(ev.stream_id, b""))
                req = router_pb2.GenerateRequest.FromString(body[5:])
                self.conn.send_headers(ev.stream_id, [(":status", "200"),
                                                      ("content-type", "application/grpc")])
                self.streams[ev.stream_id] = H2Stream(ev.stream_id, req.request_id)
            elif isinstance(ev, h2.events.WindowUpdated):
                if ev.stream_id == 0:
                    self.conn_window += ev.delta
                elif ev.stream_id in self.stream_windows:
                    self.stream_windows[ev.stream_id] += ev.delta
            elif isinstance(ev, h2.events.RemoteSettingsChanged):
                from h2.settings import SettingCodes

                changed = ev.changed_settings.get(SettingCodes.INITIAL_WINDOW_SIZE)
                if changed is not None:
                    delta = changed.new_value - self.initial_window
                    self.initial_window = changed.new_value
                    for sid in self.stream_windows:
                        self.stream_windows[sid] += delta
            elif isinstance(ev, h2.events.StreamReset):
                self.streams.pop(ev.stream_id, None)
                self.stream_windows.pop(ev.stream_id, None)
        self._flush()
        self._resume()

    def _frame(self, st: H2Stream, message: bytes) -> bytes | None:
        """The DATA frame of ``message`` on ``st``, charged to the windows; None if it
        does not fit them now."""
        n = len(message) + 5
        w = self.stream_windows.get(st.sid, 0)
        if n > w or n > self.conn_window:
            return None
        self.stream_windows[st.sid] = w - n
        self.conn_window -= n
        # frame header: length (24 bits), type DATA (0), flags 0, stream id; then the gRPC
        # prefix: not compressed (0), length (32 bits)
        return (n.to_bytes(3, "big") + b"\x00\x00" + st.sid.to_bytes(4, "big")
                + b"\x00" + len(message).to_bytes(4, "big") + message)

    def _resume(self) -> None:
        out = []
        for st in list(self.streams.values()):
            if st.pending is not None and (frame := self._frame(st, st.pending)) is not None:
                st.pending = None
                out.append(frame)
                self._sent(st)
        if out and self.transport is not None:
            self.transport.write(b"".join(out))
        self._flush()

    def _sent(self, st: H2Stream) -> None:
        st.sent += 1
        if st.sent >= self.server.messages:
            del self.streams[st.sid]
            self.stream_windows.pop(st.sid, None)
            self.conn.send_headers(st.sid, [("grpc-status", "0")], end_stream=True)

    def tick(self, tail: bytes) -> None:
        t = self.transport
        if t is None:
            return
        coalesce = self.server.coalesce
        out = []
        for st in list(self.streams.values()):
            if st.pending is not None:
                continue  # the previous message still waits for the window
            # token_ids = 2 (packed), then text = 3: the same message as the other modes
            msg = st.head + _field(0x12, _varint(1000 + st.sent)) + tail
            frame = self._frame(st, msg)
            if frame is None:
                st.pending = msg
                continue
            if coalesce:
                out.append(frame)
            else:
                t.write(frame)
            self._sent(st)
        if out:
            t.write(b"".join(out))
        self._flush()  # trailers of streams that ended


class H2Server:
    def __init__(self, messages: int, coalesce: bool) -> None:
        self.messages = messages
        self.coalesce = coalesce
        self.doors: list[H2Door] = []
        self.tail = _field(0x1A, b" tok")

    def step(self) -> None:
        for d in self.doors:
            d.tick(self.tail)


async def serve_h2(port_q: Any, messages: int, tick_s: float, coalesce: bool) -> None:
    door = H2Server(messages, coalesce)
    server = await asyncio.get_running_loop().create_server(lambda: H2Door(door),
                                                            "127.0.0.1", 0)
    port_q.put(server.sockets[0].getsockname()[1])
    while True:
        await asyncio.sleep(tick_s)
        door.step()
