"""Which transport the router's end of the plain Outputs stream takes
(router/requests/outputs_plain.py against a real worker/outputs_port.py): the Unix socket
when it can reach it (asyncio's loop and uvloop's), TCP when it cannot (another host or
network namespace), the RPC when neither answers; the transport is logged once per change,
in a bounded log. Each port gets its own unguessable abstract Unix name, and a stop frees it."""

from __future__ import annotations

import asyncio
import socket

import pytest
from outputs_port_helpers import Port, call, run_async, wait_until
from pdserve.v1 import worker_pb2

import router.requests.outputs_plain as plain
import worker.outputs_port as op

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
