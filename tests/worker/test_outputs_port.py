"""The plain Outputs stream (worker/outputs_port.py) read by the router's end of it
(router/requests/outputs_plain.py), both real, over real sockets, each case over both
listeners (TCP and the abstract Unix socket: one protocol, one code path): the batches
arrive as the hub queued them; a hello that is not a valid OutputsRequest, carries the wrong
token or never comes is answered with an OutputsEnd naming the field and the port goes on
serving; a router that leaves hands its requests back; a router that does not read gets the
steps merged, losslessly. The router reads the Unix socket when it can reach it, TCP when
it cannot (another host or network namespace), and the RPC when neither answers."""

from __future__ import annotations

import asyncio
import functools
import socket
import struct

import grpc
import pytest
from pdserve.v1 import worker_pb2

import router.requests.outputs_plain as plain
import worker.outputs_port as op
from router.requests.outputs_plain import PlainOutputsCall, PlainOutputsEnded
from worker.messages import decode, encode
from worker.output_hub import OutputHub
from worker.token_batch import TokensBatchBuilder

TOKEN = "s3cret"


def run_async(fn):  # type: ignore[no-untyped-def]
    """The test body runs on its own event loop (pytest's parameters passed through)."""
    @functools.wraps(fn)
    def test(*args, **kwargs):  # type: ignore[no-untyped-def]
        asyncio.run(fn(*args, **kwargs))
    return test

_LEN = struct.Struct(">I")
TRANSPORTS = ("tcp", "unix")


class Port:
    """An OutputsPort on a real hub, with the orphans it handed back."""

    def __init__(self, token: str = TOKEN) -> None:
        self.hub = OutputHub()
        self.orphans: list[str] = []
        self.fatal = ""
        self.port = op.OutputsPort(self.hub, token, lambda rids, why: self.orphans.extend(rids),
                                   failed=lambda: self.fatal)
        self.address = ""
        self.unix = ""  # "@name": the abstract Unix socket

    async def __aenter__(self) -> Port:
        self.address = f"127.0.0.1:{await self.port.start('127.0.0.1', 0)}"
        self.unix = await self.port.start_unix()
        return self

    def where(self, transport: str) -> dict[str, str]:
        """``call``'s arguments that reach this port over ``transport`` only (no other to
        fall back to: a stream that works went over that one)."""
        return {"address": self.address} if transport == "tcp" else {"unix": self.unix}

    async def open_raw(self, transport: str
                       ) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        """A connection a stranger opens, over ``transport``."""
        if transport == "unix":
            return await asyncio.open_unix_connection("\0" + self.unix[1:])
        host, _, port = self.address.rpartition(":")
        return await asyncio.open_connection(host, int(port))

    def raw_socket(self, transport: str) -> socket.socket:
        """A blocking socket connected over ``transport``, with a small receive buffer."""
        if transport == "unix":
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            s.connect("\0" + self.unix[1:])
            return s
        host, _, port = self.address.rpartition(":")
        s = socket.socket()
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        s.connect((host, int(port)))
        return s

    async def __aexit__(self, *exc: object) -> None:
        await self.port.stop()

    def step(self, rids: list[str], token: int, finish: str | None = None, pad: int = 0
             ) -> None:
        """One engine step's tokens for ``rids`` (as the engine process sends them); ``pad``
        lengthens each token's text."""
        b = TokensBatchBuilder()
        for i, rid in enumerate(rids):
            b.add(rid, (token + i,), f" t{token + i}" + "x" * pad, (), finish)
        self.hub.add_batch(decode(encode(b.build())))  # type: ignore[arg-type]
        self.hub.flush()


def call(address: str = "", sub: str = "router-1", token: str = TOKEN,
         fallback: object = None, unix: str = "") -> PlainOutputsCall:
    def no_fallback() -> object:
        raise AssertionError("the plain port was reachable: no fallback expected")
    return PlainOutputsCall("w0", address, worker_pb2.OutputsRequest(
        subscriber_id=sub, cluster_token=token), fallback=fallback or no_fallback,  # type: ignore[arg-type]
        unix=unix)


async def wait_until(cond, timeout: float = 5.0) -> None:  # type: ignore[no-untyped-def]
    end = asyncio.get_running_loop().time() + timeout
    while not cond():
        assert asyncio.get_running_loop().time() < end, "timed out"
        await asyncio.sleep(0.01)


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


@pytest.mark.parametrize("transport", TRANSPORTS)
@run_async
async def test_batches_arrive_in_order_and_a_router_that_leaves_hands_its_requests_back(
        transport: str) -> None:
    async with Port() as p:
        c = call(**p.where(transport))
        it = c.__aiter__()
        first = await anext(it)
        assert first.seq == 0 and not first.tokens  # subscribed
        assert c.transport == transport
        sub = p.hub.subscribers["router-1"]
        for rid in ("a", "b", "c"):
            p.hub.attach(rid, sub)
        p.step(["a", "b", "c"], 100)
        p.step(["a", "b"], 200)
        got = []
        while len(got) < 5:
            batch = await anext(it)
            got += [(t.request_id, list(t.token_ids), t.text) for t in batch.tokens]
        assert got == [("a", [100], " t100"), ("b", [101], " t101"), ("c", [102], " t102"),
                       ("a", [200], " t200"), ("b", [201], " t201")]
        c.cancel()
        await it.aclose()
        # the worker sees the close and aborts what the router left running
        await wait_until(lambda: len(p.orphans) == 3)
        assert sorted(p.orphans) == ["a", "b", "c"]
        assert "router-1" not in p.hub.subscribers


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


@pytest.mark.parametrize("transport", TRANSPORTS)
@run_async
async def test_a_failed_hub_ends_the_stream_with_unavailable(transport: str) -> None:
    async with Port() as p:
        it = call(**p.where(transport)).__aiter__()
        await anext(it)
        sub = p.hub.subscribers["router-1"]
        p.hub.attach("a", sub)
        p.step(["a"], 5)
        p.hub.fail("engine process exited")
        batch = await anext(it)  # what was queued before the failure still comes
        assert [t.request_id for t in batch.tokens] == ["a"]
        with pytest.raises(PlainOutputsEnded) as e:
            await anext(it)
        assert e.value.code == grpc.StatusCode.UNAVAILABLE
        assert "engine process exited" in str(e.value)


@pytest.mark.parametrize("transport", TRANSPORTS)
@run_async
async def test_a_failed_engine_refuses_new_streams(transport: str) -> None:
    async with Port() as p:
        p.fatal = "engine process exited"
        with pytest.raises(PlainOutputsEnded) as e:
            await anext(call(**p.where(transport)).__aiter__())
        assert e.value.code == grpc.StatusCode.UNAVAILABLE


@pytest.mark.parametrize("transport", TRANSPORTS)
@run_async
async def test_a_router_that_does_not_read_gets_the_steps_merged_losslessly(
        monkeypatch: pytest.MonkeyPatch, transport: str) -> None:
    """With the socket full, the worker's write waits and the hub merges the steps that come
    meanwhile into the next batch: fewer frames than steps, every token in order."""
    monkeypatch.setattr(op, "HIGH_WATER", 1024)
    async with Port() as p:
        s = p.raw_socket(transport)
        hello = worker_pb2.OutputsRequest(subscriber_id="slow", cluster_token=TOKEN)
        s.sendall(_LEN.pack(hello.ByteSize()) + hello.SerializeToString())
        await wait_until(lambda: "slow" in p.hub.subscribers)
        sub = p.hub.subscribers["slow"]
        rids = [f"r{i:03d}" for i in range(64)]
        for rid in rids:
            p.hub.attach(rid, sub)
        steps = 200
        for k in range(steps):  # ~13 MB of batches: past what the sockets' buffers take
            p.step(rids, 1000 * k, pad=1000)
            await asyncio.sleep(0)
        s.setblocking(False)
        loop = asyncio.get_running_loop()
        buf = b""
        frames: list[worker_pb2.OutputsFrame] = []
        want = steps * len(rids)
        while sum(len(f.batch.tokens) for f in frames) < want:
            buf += await asyncio.wait_for(loop.sock_recv(s, 1 << 16), 10)
            while len(buf) >= 4 and len(buf) >= 4 + _LEN.unpack(buf[:4])[0]:
                (n,) = _LEN.unpack(buf[:4])
                frames.append(worker_pb2.OutputsFrame.FromString(buf[4:4 + n]))
                buf = buf[4 + n:]
        s.close()
        tokens = [(t.request_id, t.token_ids[0]) for f in frames for t in f.batch.tokens]
        assert tokens == [(rid, 1000 * k + i) for k in range(steps)
                          for i, rid in enumerate(rids)]
        assert len(frames) - 1 < steps  # merged: the first frame is the empty one


# an abstract name nobody listens on: what a router on another host (or in another network
# namespace) meets when it dials a worker's Unix socket
NOWHERE = f"@{op.UNIX_PREFIX}{'0' * 32}"


def run_on(event_loop: str, coro):  # type: ignore[no-untyped-def]
    """``coro``'s result, run on asyncio's loop or uvloop's (the router's default where
    installed: the two differ in how they take an abstract Unix name)."""
    if event_loop == "uvloop":
        return pytest.importorskip("uvloop").run(coro)
    return asyncio.run(coro)


@pytest.mark.parametrize("event_loop", ("asyncio", "uvloop"))
def test_the_router_reads_the_unix_socket_when_it_can_reach_it(event_loop: str) -> None:
    """Both advertised (a worker on this host): the stream goes over the Unix socket."""
    run_on(event_loop, _reads_the_unix_socket())


async def _reads_the_unix_socket() -> None:
    async with Port() as p:
        c = call(p.address, unix=p.unix)
        it = c.__aiter__()
        assert (await anext(it)).seq == 0 and c.transport == "unix" and c.plain
        ((_, writer),) = p.port.live.values()  # the worker's end is a Unix socket too
        assert writer.get_extra_info("socket").family == socket.AF_UNIX
        p.hub.attach("a", p.hub.subscribers["router-1"])
        p.step(["a"], 7)
        assert [t.request_id for t in (await anext(it)).tokens] == ["a"]
        c.cancel()
        await it.aclose()


@pytest.mark.parametrize("event_loop", ("asyncio", "uvloop"))
def test_an_unreachable_unix_socket_falls_back_to_tcp_and_batches_arrive(
        caplog: pytest.LogCaptureFixture, event_loop: str) -> None:
    import logging

    caplog.set_level(logging.INFO, logger=plain.__name__)
    plain._logged.clear()
    address = run_on(event_loop, _falls_back_to_tcp())
    lines = [r.getMessage() for r in caplog.records if "reading its Outputs" in r.getMessage()]
    assert len(lines) == 1, lines
    assert f"over tcp {address}" in lines[0] and NOWHERE in lines[0]


async def _falls_back_to_tcp() -> str:
    async with Port() as p:
        for _ in range(2):  # a second stream (a reconnect) logs nothing new
            c = call(p.address, unix=NOWHERE)
            it = c.__aiter__()
            assert (await anext(it)).seq == 0
            assert c.transport == "tcp" and c.plain
            p.hub.attach("a", p.hub.subscribers["router-1"])
            p.step(["a"], 7)
            assert [t.request_id for t in (await anext(it)).tokens] == ["a"]
            c.cancel()
            await it.aclose()
            await wait_until(lambda: not p.hub.subscribers)
        return p.address


def test_each_port_gets_its_own_unguessable_unix_name() -> None:
    async def names() -> list[str]:
        out = []
        for _ in range(2):
            async with Port() as p:
                out.append(p.unix)
        return out

    a, b = asyncio.run(names())
    assert a != b
    for name in (a, b):
        assert name.startswith("@" + op.UNIX_PREFIX)
        assert len(name) == 1 + len(op.UNIX_PREFIX) + 32  # a uuid4's 122 random bits


@run_async
async def test_stop_closes_the_unix_listener() -> None:
    """A stopped worker's name is free again and nothing answers on it (nothing leaks)."""
    p = Port()
    await p.__aenter__()
    await p.port.stop()
    with pytest.raises(ConnectionRefusedError):
        await p.open_raw("unix")
    again = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    again.bind("\0" + p.unix[1:])  # the name was released
    again.close()


@run_async
async def test_an_unreachable_port_falls_back_to_the_rpc() -> None:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    dead = f"127.0.0.1:{s.getsockname()[1]}"  # bound, never listening: refused
    batches = [worker_pb2.OutputBatch(seq=0), worker_pb2.OutputBatch(seq=1)]

    class Rpc:
        cancelled = False

        def cancel(self) -> None:
            self.cancelled = True

        async def __aiter__(self):  # type: ignore[no-untyped-def]
            for b in batches:
                yield b

    rpc = Rpc()
    c = call(dead, fallback=lambda: rpc, unix=NOWHERE)
    assert c.plain
    got = [b.seq async for b in c]
    s.close()
    assert got == [0, 1] and not c.plain and c.transport == "grpc"


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


@pytest.mark.parametrize("transport", TRANSPORTS)
@run_async
async def test_stop_writes_what_was_queued_before_ending_the_streams(transport: str) -> None:
    """A drained worker's last tokens are queued just before it stops: they still go out."""
    p = Port()
    await p.__aenter__()
    it = call(**p.where(transport)).__aiter__()
    await anext(it)
    sub = p.hub.subscribers["router-1"]
    p.hub.attach("a", sub)
    p.step(["a"], 9, finish="length")
    await p.port.stop()  # no yield between the step and the stop
    batch = await anext(it)
    assert [(t.request_id, list(t.token_ids)) for t in batch.tokens] == [("a", [9])]
    with pytest.raises(PlainOutputsEnded) as e:
        await anext(it)
    assert e.value.code == grpc.StatusCode.UNAVAILABLE


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


def test_the_transport_log_is_said_once_per_change_and_stays_bounded(monkeypatch) -> None:
    """The router logs a worker's transport when it changes, and forgets the oldest workers
    past LOGGED_KEPT (ids that come and go must not grow it for good)."""
    monkeypatch.setattr(plain, "_logged", type(plain._logged)())
    monkeypatch.setattr(plain, "LOGGED_KEPT", 3)
    assert plain._log_once("w0", "unix") and not plain._log_once("w0", "unix")
    assert plain._log_once("w0", "tcp")  # a change is said again
    for i in range(1, 6):
        assert plain._log_once(f"w{i}", "unix")
    assert list(plain._logged) == ["w3", "w4", "w5"]
