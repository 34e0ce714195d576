"""One connection of the stream door driven in memory (a client h2 connection on one side,
a transport that collects the bytes on the other): a paused transport holds a message
until ``resume_writing``, and a stream the client resets raises on the next write."""

from __future__ import annotations

import asyncio
from typing import Any

import h2.config
import h2.connection
import h2.events
import pytest
from pdserve.v1 import router_pb2

from router.grpc_stream.call import StreamCall, StreamGone
from router.grpc_stream.connection import GrpcConnection


class Transport:
    def __init__(self) -> None:
        self.out = bytearray()
        self.closed = False

    def write(self, data: bytes) -> None:
        self.out += data

    def close(self) -> None:
        self.closed = True

    def get_extra_info(self, name: str) -> Any:
        return None


class Door:
    api_key = ""
    max_receive = 1 << 20

    def __init__(self) -> None:
        self.connections: set[GrpcConnection] = set()
        self.calls: list[tuple[StreamCall, router_pb2.GenerateRequest]] = []

    async def serve(self, call: StreamCall, request: router_pb2.GenerateRequest) -> None:
        self.calls.append((call, request))
        await asyncio.Event().wait()  # held open: the test writes to the call itself


def _pair() -> tuple[GrpcConnection, Transport, h2.connection.H2Connection, Door, int]:
    door, t = Door(), Transport()
    conn = GrpcConnection(door)
    conn.connection_made(t)  # type: ignore[arg-type]
    client = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True,
                                                                  header_encoding="utf-8"))
    client.initiate_connection()
    sid = client.get_next_available_stream_id()
    client.send_headers(sid, [(":method", "POST"), (":scheme", "http"),
                              (":path", "/pdserve.v1.Router/Generate"),
                              (":authority", "x"), ("content-type", "application/grpc")])
    body = router_pb2.GenerateRequest(prompt="hi").SerializeToString()
    client.send_data(sid, b"\x00" + len(body).to_bytes(4, "big") + body, end_stream=True)
    conn.data_received(client.data_to_send())
    client.receive_data(bytes(t.out))  # the server's SETTINGS
    t.out.clear()
    return conn, t, client, door, sid


def _data(client: h2.connection.H2Connection, t: Transport) -> bytes:
    evs = client.receive_data(bytes(t.out))
    t.out.clear()
    return b"".join(e.data for e in evs if isinstance(e, h2.events.DataReceived))


def test_a_paused_transport_holds_the_message_until_resumed() -> None:
    async def main() -> None:
        conn, t, client, door, sid = _pair()
        await asyncio.sleep(0)
        ((call, req),) = door.calls
        assert req.prompt == "hi"
        resp = router_pb2.GenerateResponse(request_id="r", token_ids=[7], text=" x")
        assert call.write_now(resp)
        assert _data(client, t)[5:] == resp.SerializeToString()
        conn.pause_writing()
        assert not call.write_now(resp)  # DirectWrite then takes ``write``
        w = asyncio.ensure_future(call.write(resp))
        await asyncio.sleep(0.01)
        assert not w.done() and _data(client, t) == b""
        conn.resume_writing()
        await asyncio.wait_for(w, 1)
        assert _data(client, t)[5:] == resp.SerializeToString()
        # the client resets the stream: the handler is cancelled, writes raise
        client.reset_stream(sid)
        conn.data_received(client.data_to_send())
        await asyncio.sleep(0)
        assert call.task is not None and call.task.cancelled()
        with pytest.raises(StreamGone):
            call.write_now(resp)

    asyncio.run(main())
