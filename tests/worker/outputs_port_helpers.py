"""What the plain Outputs port's tests share (tests/worker/test_outputs_port_*.py): an
OutputsPort on a real hub listening on both TCP and the abstract Unix socket (``Port``), the
router's end of the stream (``call``), the frame length prefix, and small async helpers. The
test files put this folder on sys.path to import it (importlib import mode adds none)."""

from __future__ import annotations

import asyncio
import functools
import socket
import struct

from pdserve.v1 import worker_pb2

import worker.outputs_port as op
from router.requests.outputs_plain import PlainOutputsCall
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
