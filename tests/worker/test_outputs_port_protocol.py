"""The plain Outputs port's wire protocol and hello (worker/outputs_port.py, read by
router/requests/outputs_plain.py, both real, over real sockets, over both listeners where it
applies): a batch frame is a length-prefixed OutputsFrame equal to protobuf's own; a hello
that is not a valid OutputsRequest, carries the wrong token, is too long, half sent or never
comes is answered with one OutputsEnd naming the field and a close, and the port goes on
serving; a wrong token on the Unix socket ends the router's stream (no fallback to TCP);
junk from strangers never subscribes; a frame past the router's cap is not believed."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from outputs_port_helpers import (
    _LEN,
    TOKEN,
    TRANSPORTS,
    Port,
    call,
    run_async,
    wait_until,
)
from pdserve.v1 import worker_pb2

import router.requests.outputs_plain as plain
import worker.outputs_port as op
from router.requests.outputs_plain import PlainOutputsEnded


def test_batch_frame_is_an_outputs_frame() -> None:
    """The hand-built frame parses as OutputsFrame(batch=...) and equals protobuf's own."""
    batch = worker_pb2.OutputBatch(seq=7)
    for i in range(300):  # a body past 127 bytes: a multi-byte length varint
        t = batch.tokens.add(request_id=f"cmpl-{i}", text=" x")
        t.token_ids.append(i)
    frame = op.batch_frame(batch)
    (n,) = _LEN.unpack(frame[:4])
    assert n == len(frame) - 4
    assert frame[4:] == worker_pb2.OutputsFrame(batch=batch).SerializeToString()
    assert worker_pb2.OutputsFrame.FromString(frame[4:]).batch == batch


async def _raw_hello(p: Port, transport: str, payload: bytes, send_len: int | None = None
                     ) -> worker_pb2.OutputsEnd:
    reader, writer = await p.open_raw(transport)
    writer.write(_LEN.pack(len(payload) if send_len is None else send_len) + payload)
    (n,) = _LEN.unpack(await reader.readexactly(4))
    frame = worker_pb2.OutputsFrame.FromString(await reader.readexactly(n))
    assert await reader.read() == b""  # and the worker closed the connection
    writer.close()
    assert frame.WhichOneof("kind") == "end"
    return frame.end


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("payload,send_len,code,names", [
    (b"\xff" * 10, None, grpc.StatusCode.INVALID_ARGUMENT, "OutputsRequest"),
    (b"", 1 << 20, grpc.StatusCode.RESOURCE_EXHAUSTED, "OutputsRequest"),
    (worker_pb2.OutputsRequest(subscriber_id="r", cluster_token="nope").SerializeToString(),
     None, grpc.StatusCode.UNAUTHENTICATED, "cluster_token"),
    (worker_pb2.OutputsRequest(cluster_token=TOKEN).SerializeToString(), None,
     grpc.StatusCode.INVALID_ARGUMENT, "subscriber_id"),
    (worker_pb2.OutputsRequest(subscriber_id="r" * 300, cluster_token=TOKEN)
     .SerializeToString(), None, grpc.StatusCode.INVALID_ARGUMENT, "subscriber_id"),
])
@run_async
async def test_a_bad_hello_is_refused_naming_the_field_and_the_port_serves_on(
        payload: bytes, send_len: int | None, code: grpc.StatusCode, names: str,
        transport: str) -> None:
    async with Port() as p:
        end = await _raw_hello(p, transport, payload, send_len)
        assert end.code == code.value[0], end
        assert names in end.message
        assert p.port.refused == 1 and not p.hub.subscribers
        # a valid router is served after it, over either listener
        for other in TRANSPORTS:
            c = call(**p.where(other))
            it = c.__aiter__()
            assert (await anext(it)).seq == 0
            c.cancel()
            await it.aclose()
            await wait_until(lambda: not p.hub.subscribers)


@run_async
async def test_a_wrong_token_on_the_unix_socket_ends_the_stream_with_no_fallback_to_tcp(
        ) -> None:
    """The router's end: the Unix socket connected and refused the hello; TCP would refuse
    it the same way, so the refusal is the stream's end, naming the field."""
    async with Port() as p:
        c = call(p.address, unix=p.unix, token="nope")
        with pytest.raises(PlainOutputsEnded) as e:
            await anext(c.__aiter__())
        assert e.value.code == grpc.StatusCode.UNAUTHENTICATED
        assert "cluster_token" in str(e.value)
        assert c.transport == "unix" and p.port.refused == 1


@pytest.mark.parametrize("transport", TRANSPORTS)
@run_async
async def test_silence_and_half_a_hello_end_without_a_subscriber(monkeypatch, transport) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setattr(op, "HELLO_TIMEOUT_S", 0.3)
    async with Port() as p:
        reader, writer = await p.open_raw(transport)
        writer.write(b"\x00\x00")  # half a length, then nothing
        (n,) = _LEN.unpack(await asyncio.wait_for(reader.readexactly(4), 5))
        end = worker_pb2.OutputsFrame.FromString(await reader.readexactly(n)).end
        assert end.code == grpc.StatusCode.DEADLINE_EXCEEDED.value[0]
        assert "OutputsRequest" in end.message
        writer.close()
        # a client that connects and leaves at once costs nothing either
        p.raw_socket(transport).close()
        await wait_until(lambda: not p.port.streams)
        assert not p.hub.subscribers


@run_async
async def test_a_frame_past_the_cap_ends_the_stream(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """A worker (or anything at its address) sending a huge length is not believed."""
    monkeypatch.setattr(plain, "MAX_FRAME", 1000)

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.read(100)
        writer.write(_LEN.pack(5000) + b"x" * 10)

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    address = f"127.0.0.1:{server.sockets[0].getsockname()[1]}"
    with pytest.raises(PlainOutputsEnded) as e:
        await anext(call(address).__aiter__())
    assert e.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "OutputsFrame" in str(e.value)
    server.close()


def _junk(rng, n: int) -> list[bytes]:  # type: ignore[no-untyped-def]
    """Hellos a stranger might send: random bytes, random bytes behind a plausible length,
    a length promising more than comes, valid requests with junk appended."""
    out = []
    for i in range(n):
        body = rng.randbytes(rng.randrange(0, 64))
        kind = i % 4
        if kind == 0:
            out.append(body)
        elif kind == 1:
            out.append(_LEN.pack(len(body)) + body)
        elif kind == 2:
            out.append(_LEN.pack(len(body) + rng.randrange(1, 100)) + body)
        else:
            req = worker_pb2.OutputsRequest(subscriber_id=body.hex()[:20], cluster_token="x")
            data = req.SerializeToString() + body
            out.append(_LEN.pack(len(data)) + data)
    return out


@pytest.mark.parametrize("transport", TRANSPORTS)
@run_async
async def test_junk_from_strangers_never_subscribes_and_the_port_serves_on(transport) -> None:  # type: ignore[no-untyped-def]
    """Whatever a stranger sends, the answer is at most one OutputsEnd and a close: no
    subscriber is made, no task is left behind, and the router's stream still works."""
    import random

    async with Port() as p:
        for junk in _junk(random.Random(20261203), 200):
            reader, writer = await p.open_raw(transport)
            writer.write(junk)
            writer.write_eof()
            data = await asyncio.wait_for(reader.read(), 5)
            writer.close()
            if data:  # one OutputsEnd frame, nothing else
                (n,) = _LEN.unpack(data[:4])
                assert len(data) == 4 + n, junk
                frame = worker_pb2.OutputsFrame.FromString(data[4:])
                assert frame.WhichOneof("kind") == "end", junk
                assert frame.end.code != grpc.StatusCode.OK.value[0]
            assert not p.hub.subscribers, junk
        await wait_until(lambda: not p.port.streams)
        it = call(**p.where(transport)).__aiter__()
        assert (await anext(it)).seq == 0
