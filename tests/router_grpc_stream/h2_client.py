"""A raw HTTP/2 client (the h2 package on a socket) for what grpcio will not send: junk
bytes, a bad preface, a declared message past the limit, a reader that holds its window."""

from __future__ import annotations

import socket
import time
from typing import Any

import h2.config
import h2.connection
import h2.events
import h2.settings


class RawH2:
    def __init__(self, port: int, *, window: int = 65535, key: str = "") -> None:
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=10)
        self.h2 = h2.connection.H2Connection(h2.config.H2Configuration(
            client_side=True, header_encoding="utf-8"))
        self.h2.local_settings = h2.settings.Settings(client=True, initial_values={
            h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: window})
        self.h2.initiate_connection()
        self.key = key
        self.events: list[Any] = []
        self.send()

    def send(self) -> None:
        self.sock.sendall(self.h2.data_to_send())

    def start(self, body: bytes, path: str = "/pdserve.v1.Router/Generate") -> int:
        sid = self.h2.get_next_available_stream_id()
        headers = [(":method", "POST"), (":scheme", "http"), (":path", path),
                   (":authority", "localhost"), ("content-type", "application/grpc"),
                   ("te", "trailers")]
        if self.key:
            headers.append(("authorization", f"Bearer {self.key}"))
        self.h2.send_headers(sid, headers)
        self.h2.send_data(sid, body, end_stream=True)
        self.send()
        return sid

    def read(self, until: Any, timeout: float = 20.0, ack: bool = True) -> list[Any]:
        """Reads events until ``until(events)``; ``ack``: opens the windows for what came."""
        end = time.monotonic() + timeout
        while not until(self.events):
            if time.monotonic() > end:
                raise TimeoutError(f"events so far: {self.events}")
            try:
                data = self.sock.recv(65536)
            except TimeoutError as e:
                raise TimeoutError(f"events so far: {self.events}") from e
            if not data:
                self.events.append("EOF")
                break
            for ev in self.h2.receive_data(data):
                self.events.append(ev)
                if ack and isinstance(ev, h2.events.DataReceived):
                    self.h2.acknowledge_received_data(ev.flow_controlled_length, ev.stream_id)
            self.send()
        return self.events

    def close(self) -> None:
        self.sock.close()


def ended(sid: int) -> Any:
    return lambda evs: "EOF" in evs or any(
        isinstance(e, h2.events.StreamEnded) and e.stream_id == sid for e in evs)


def trailers(events: list[Any], sid: int) -> dict[str, str]:
    out: dict[str, str] = {}
    for e in events:
        if isinstance(e, (h2.events.TrailersReceived, h2.events.ResponseReceived)) \
                and e.stream_id == sid:
            out.update(dict(e.headers))
    return out


def messages(events: list[Any], sid: int) -> tuple[list[bytes], int]:
    """The stream's gRPC messages, and how many DATA frames carried them."""
    buf = b"".join(e.data for e in events
                   if isinstance(e, h2.events.DataReceived) and e.stream_id == sid)
    frames = sum(1 for e in events
                 if isinstance(e, h2.events.DataReceived) and e.stream_id == sid and e.data)
    out = []
    while buf:
        n = int.from_bytes(buf[1:5], "big")
        out.append(buf[5:5 + n])
        buf = buf[5 + n:]
    return out, frames


def frame_types(data: bytes) -> list[int]:
    """The type of every whole HTTP/2 frame in ``data`` (a server's bytes, from its first)."""
    out = []
    while len(data) >= 9:
        n = int.from_bytes(data[:3], "big")
        out.append(data[3])
        data = data[9 + n:]
    return out
