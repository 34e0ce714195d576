"""deploy/benchmark/h2_connection.py against frames a server would send, fed by hand: split
and padded DATA, messages across frames, header blocks with CONTINUATION, SETTINGS and PING
answered, the peer's stream limit and windows honoured, RST_STREAM, GOAWAY and a lost
connection failing the calls they name. Against the real router: test_h2_backend_live.py."""

from __future__ import annotations

import asyncio
import struct

import hpack
import pytest

from deploy.benchmark.h2_connection import (
    CONTINUATION,
    DATA,
    END_HEADERS,
    END_STREAM,
    GOAWAY,
    HEADERS,
    PADDED,
    PING,
    PREFACE,
    RST_STREAM,
    SETTINGS,
    WINDOW_UPDATE,
    CallEnded,
    H2Connection,
    _frame,
)


class Transport(asyncio.Transport):
    def __init__(self) -> None:
        super().__init__()
        self.out = bytearray()
        self.closed = False

    def write(self, data: bytes) -> None:  # type: ignore[override]
        self.out += data

    def is_closing(self) -> bool:
        return self.closed

    def close(self) -> None:
        self.closed = True


def frames(data: bytes) -> list[tuple[int, int, int, bytes]]:
    """(type, flags, stream, payload) of what the client wrote, after its preface."""
    assert data.startswith(PREFACE)
    out, at = [], len(PREFACE)
    while at < len(data):
        n = int.from_bytes(data[at:at + 3], "big")
        out.append((data[at + 3], data[at + 4],
                    int.from_bytes(data[at + 5:at + 9], "big") & 0x7FFFFFFF,
                    bytes(data[at + 9:at + 9 + n])))
        at += 9 + n
    return out


def grpc_msg(payload: bytes) -> bytes:
    return b"\0" + len(payload).to_bytes(4, "big") + payload


def connect() -> tuple[H2Connection, Transport, hpack.Encoder]:
    conn, t = H2Connection("test:1"), Transport()
    conn.connection_made(t)
    return conn, t, hpack.Encoder()


def trailers(enc: hpack.Encoder, status: int = 0, message: str = "") -> bytes:
    block = [("grpc-status", str(status))] + ([("grpc-message", message)] if message else [])
    return enc.encode(block)


def run(coro):  # type: ignore[no-untyped-def]
    return asyncio.run(coro)


def test_messages_arrive_whole_whatever_the_frames_and_chunks():
    async def go():
        conn, t, enc = connect()
        got: list[bytes] = []
        call = await conn.call("/pdserve.v1.Router/Generate", b"req", [("x-k", "v")], got.append)
        # the request: HEADERS (our headers decoded by a server's HPACK), one DATA, ended
        sent = frames(bytes(t.out))
        kinds = [(k, f, s) for k, f, s, _ in sent]
        assert kinds[:2] == [(SETTINGS, 0, 0), (WINDOW_UPDATE, 0, 0)]
        assert kinds[2] == (HEADERS, END_HEADERS, 1) and kinds[3] == (DATA, END_STREAM, 1)
        headers = dict(hpack.Decoder().decode(sent[2][3]))
        assert headers[":path"] == "/pdserve.v1.Router/Generate"
        assert headers["content-type"] == "application/grpc" and headers["x-k"] == "v"
        assert sent[3][3] == grpc_msg(b"req")
        one, two, three = grpc_msg(b"a" * 10), grpc_msg(b""), grpc_msg(b"c" * 70_000)
        body = one + two + three
        wire = (_frame(HEADERS, END_HEADERS, 1, enc.encode([(":status", "200")]))
                # the first part padded with 3 bytes: b"\x03" + data + padding
                + _frame(DATA, PADDED, 1, b"\x03" + body[:7] + b"\0\0\0")
                + _frame(DATA, 0, 1, body[7:40_000]) + _frame(DATA, 0, 1, body[40_000:])
                + _frame(HEADERS, END_HEADERS | END_STREAM, 1, trailers(enc)))
        for i in range(0, len(wire), 997):  # TCP chunks that cut frames anywhere
            conn.data_received(wire[i:i + 997])
        assert got == [b"a" * 10, b"", b"c" * 70_000]
        assert await call.done == (0, "") and not conn.calls
    run(go())


def test_a_trailers_only_error_and_a_header_block_in_continuations():
    async def go():
        conn, t, enc = connect()
        call = await conn.call("/p", b"", [], lambda m: None)
        block = trailers(enc, 3, "prompt_token_ids: 10000000 is outside the vocabulary")
        wire = (_frame(HEADERS, END_STREAM, 1, block[:5]) + _frame(CONTINUATION, 0, 1, block[5:9])
                + _frame(CONTINUATION, END_HEADERS, 1, block[9:]))
        conn.data_received(wire)
        assert await call.done == (3, "prompt_token_ids: 10000000 is outside the vocabulary")
    run(go())


def test_settings_and_pings_are_answered_and_the_stream_limit_is_kept():
    async def go():
        conn, t, enc = connect()
        settings = struct.pack(">HI", 0x3, 1)  # MAX_CONCURRENT_STREAMS 1
        conn.data_received(_frame(SETTINGS, 0, 0, settings) + _frame(PING, 0, 0, b"12345678"))
        sent = frames(bytes(t.out))
        assert (SETTINGS, 1, 0, b"") in sent and (PING, 1, 0, b"12345678") in sent
        first = await conn.call("/p", b"", [], lambda m: None)
        second = asyncio.ensure_future(conn.call("/p", b"", [], lambda m: None))
        await asyncio.sleep(0.01)
        assert not second.done()  # one stream open: the second waits for it
        conn.data_received(_frame(HEADERS, END_HEADERS | END_STREAM, 1, trailers(enc)))
        assert await first.done == (0, "")
        call = await asyncio.wait_for(second, 1)
        assert call.stream_id == 3
    run(go())


def test_a_request_waits_for_the_peers_window():
    async def go():
        conn, t, enc = connect()
        conn.data_received(_frame(SETTINGS, 0, 0, struct.pack(">HI", 0x4, 100)))  # 100 B
        task = asyncio.ensure_future(conn.call("/p", b"x" * 250, [], lambda m: None))
        await asyncio.sleep(0.01)
        data = [p for k, _, s, p in frames(bytes(t.out)) if k == DATA]
        assert sum(map(len, data)) == 100 and not task.done()
        conn.data_received(_frame(WINDOW_UPDATE, 0, 1, struct.pack(">I", 1000)))
        await asyncio.wait_for(task, 1)
        sent = [(f, p) for k, f, s, p in frames(bytes(t.out)) if k == DATA]
        assert b"".join(p for _, p in sent) == grpc_msg(b"x" * 250)
        assert [f for f, _ in sent] == [0, END_STREAM]
    run(go())


def test_reset_goaway_and_a_lost_connection_fail_their_calls():
    async def go():
        conn, t, enc = connect()
        calls = [await conn.call("/p", b"", [], lambda m: None) for _ in range(3)]  # 1, 3, 5
        conn.data_received(_frame(RST_STREAM, 0, 1, struct.pack(">I", 0x8)))
        with pytest.raises(CallEnded, match="CANCELLED"):
            await calls[0].done
        conn.data_received(_frame(GOAWAY, 0, 0, struct.pack(">II", 3, 0)))  # last: 3
        with pytest.raises(CallEnded, match="UNAVAILABLE.*GOAWAY"):
            await calls[2].done
        with pytest.raises(CallEnded, match="GOAWAY"):  # no new calls after it
            await conn.call("/p", b"", [], lambda m: None)
        assert not calls[1].done.done()  # stream 3 may still finish...
        conn.connection_lost(None)  # ...but not once the connection is gone
        with pytest.raises(CallEnded, match="UNAVAILABLE: connection closed"):
            await calls[1].done
    run(go())


def test_a_compressed_message_resets_its_call_and_junk_closes_the_connection():
    async def go():
        conn, t, enc = connect()
        a = await conn.call("/p", b"", [], lambda m: None)
        b = await conn.call("/p", b"", [], lambda m: None)
        conn.data_received(_frame(DATA, 0, 1, b"\x01\0\0\0\x01z"))
        with pytest.raises(CallEnded, match="INTERNAL: compressed"):
            await a.done
        assert (RST_STREAM, 0, 1, struct.pack(">I", 0x8)) in frames(bytes(t.out))
        conn.data_received(_frame(CONTINUATION, END_HEADERS, 3, b""))  # no HEADERS before
        with pytest.raises(CallEnded, match="CONTINUATION without HEADERS"):
            await b.done
        assert t.closed
    run(go())
