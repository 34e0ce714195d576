"""The router's end of a worker's plain Outputs stream (worker/outputs_port.py): a Unix
socket on the worker's host, else TCP.

A worker that advertises ``outputs_address`` at registration serves the same batches as
its ``Outputs`` RPC there, one socket write per engine step instead of a grpc.aio write
whose completion wakes the worker's loop once more per step. This is the call object
``WorkerOutputs`` iterates in place of the RPC's: ``async for`` yields ``OutputBatch``es,
``cancel()`` closes it, and an end the worker sends (or a broken connection) raises
``PlainOutputsEnded`` with the gRPC status code the RPC would have ended with.

Which transport, tried in this order when the stream opens:

1. ``outputs_unix``, the worker's abstract Unix socket: the same protocol at about 40% less
   of the worker's CPU per write than loopback TCP. Abstract names belong to a network
   namespace, so from another host (or pod) the connect fails at once (ECONNREFUSED) and
   costs one system call.
2. ``outputs_address``, its TCP port.
3. The ``Outputs`` RPC, with a warning: a port the router cannot reach (a firewall or
   network policy that opens only the gRPC port) is not an error, since both carry the
   same batches.

A socket that connects but then refuses the hello (a wrong token) is not fallen back from:
the other transports would refuse it the same way, and the error must show.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import struct
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc
from google.protobuf.message import DecodeError
from pdserve.v1 import worker_pb2

log = logging.getLogger(__name__)

CONNECT_TIMEOUT_S = 5.0
# Largest frame taken from a worker: a step's batch for thousands of requests is well under
# a megabyte; the cap only keeps a broken peer from making the router allocate at will (the
# gRPC channels' own cap, router/requests/channels.py MAX_MESSAGE_BYTES).
MAX_FRAME = 64 << 20
_LEN = struct.Struct(">I")
_CODES = {c.value[0]: c for c in grpc.StatusCode}
# worker id -> the transport last logged for it: the choice is logged when it changes, not
# at every stream a worker's restarts or drops make this router open. Bounded (oldest id
# forgotten first): workers that come and go under new ids must not grow it for good.
_logged: OrderedDict[str, str] = OrderedDict()
LOGGED_KEPT = 4096


def _log_once(worker_id: str, transport: str) -> bool:
    """Records `transport` as the one logged for the worker; False if it already was."""
    if _logged.get(worker_id) == transport:
        return False
    _logged[worker_id] = transport
    _logged.move_to_end(worker_id)
    while len(_logged) > LOGGED_KEPT:
        _logged.popitem(last=False)
    return True


async def _open_abstract(name: str) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A stream to the abstract Unix socket ``name`` ("@" for its NUL byte). Connected here
    and handed over, since uvloop's open_unix_connection(path) measures the path as a C
    string and refuses an abstract name (EINVAL) where asyncio's takes it."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.setblocking(False)
    try:
        await asyncio.get_running_loop().sock_connect(sock, "\0" + name[1:])
        return await asyncio.open_unix_connection(sock=sock)
    except BaseException:
        sock.close()
        raise


class PlainOutputsEnded(Exception):
    """The stream ended: the worker's ``OutputsEnd``, or the connection broke (``code``)."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code


class PlainOutputsCall:
    def __init__(self, worker_id: str, address: str, request: worker_pb2.OutputsRequest,
                 fallback: Callable[[], Any], unix: str = "") -> None:
        self.worker_id = worker_id
        self.address = address  # its TCP port, host:port ("": none)
        self.unix = unix  # its abstract Unix socket, "@name" ("": none)
        self.request = request
        # what is read: the first transport to try until the stream connects
        self.transport = "unix" if unix else "tcp"
        self._fallback = fallback  # opens the Outputs RPC (a port the router cannot reach)
        self._writer: asyncio.StreamWriter | None = None
        self._rpc: Any = None
        self._cancelled = False

    @property
    def plain(self) -> bool:
        """False once the port was found unreachable and the RPC is read instead."""
        return self._rpc is None

    def cancel(self) -> None:
        self._cancelled = True
        if self._writer is not None:
            self._writer.close()
        if self._rpc is not None:
            self._rpc.cancel()

    async def _connect(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter] | None:
        """The first transport that connects (``transport`` says which), or None: none
        did, and the RPC is read."""
        failed: list[str] = []
        for transport, where in (("unix", self.unix), ("tcp", self.address)):
            if not where:
                continue
            try:
                if transport == "unix":
                    opening = _open_abstract(where)
                else:
                    host, _, port = where.rpartition(":")
                    opening = asyncio.open_connection(host.strip("[]"), int(port))
                reader, writer = await asyncio.wait_for(opening, CONNECT_TIMEOUT_S)
            except (OSError, TimeoutError) as e:
                failed.append(f"{transport} {where}: {e!r}")
                continue
            self.transport = transport
            if _log_once(self.worker_id, transport):
                why = f" ({'; '.join(failed)}: another host or network namespace)" \
                    if failed else ""
                log.info("%s: reading its Outputs stream over %s %s%s", self.worker_id,
                         transport, where, why)
            return reader, writer
        self.transport = "grpc"
        _log_once(self.worker_id, "grpc")
        log.warning("%s: its Outputs stream is unreachable (%s); reading its Outputs RPC "
                    "instead", self.worker_id, "; ".join(failed))
        return None

    async def __aiter__(self) -> AsyncIterator[worker_pb2.OutputBatch]:
        connected = await self._connect()
        if connected is None:
            self._rpc = self._fallback()
            if self._cancelled:
                self._rpc.cancel()
            async for batch in self._rpc:
                yield batch
            return
        reader, writer = connected
        self._writer = writer
        try:
            hello = self.request.SerializeToString()
            writer.write(_LEN.pack(len(hello)) + hello)
            while True:
                yield self._batch(await self._frame(reader))
        finally:
            writer.close()

    async def _frame(self, reader: asyncio.StreamReader) -> worker_pb2.OutputsFrame:
        try:
            (n,) = _LEN.unpack(await reader.readexactly(_LEN.size))
            if n > MAX_FRAME:
                raise PlainOutputsEnded(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                        f"OutputsFrame: {n} bytes, more than {MAX_FRAME}")
            return worker_pb2.OutputsFrame.FromString(await reader.readexactly(n))
        except (asyncio.IncompleteReadError, ConnectionError) as e:
            raise PlainOutputsEnded(grpc.StatusCode.UNAVAILABLE,
                                    f"the worker closed its Outputs connection ({e!r})") from None
        except DecodeError as e:
            raise PlainOutputsEnded(grpc.StatusCode.INTERNAL,
                                    f"OutputsFrame: not a valid message: {e}") from None

    @staticmethod
    def _batch(frame: worker_pb2.OutputsFrame) -> worker_pb2.OutputBatch:
        kind = frame.WhichOneof("kind")
        if kind == "batch":
            return frame.batch
        if kind == "end":
            code = _CODES.get(frame.end.code, grpc.StatusCode.UNKNOWN)
            raise PlainOutputsEnded(code, frame.end.message)
        raise PlainOutputsEnded(grpc.StatusCode.INTERNAL, "OutputsFrame: neither batch nor end")
