"""The router's end of a worker's Outputs stream over plain TCP (worker/outputs_port.py).

A worker that advertises ``outputs_address`` at registration serves the same batches as
its ``Outputs`` RPC there, one socket write per engine step instead of a grpc.aio write
whose completion wakes the worker's loop once more per step. This is the call object
``WorkerOutputs`` iterates in place of the RPC's: ``async for`` yields ``OutputBatch``es,
``cancel()`` closes it, and an end the worker sends (or a broken connection) raises
``PlainOutputsEnded`` with the gRPC status code the RPC would have ended with.

A port the router cannot reach (a firewall or network policy that opens only the gRPC
port) is not an error: the stream then reads the RPC, with a warning, since both carry
the same batches.
"""

from __future__ import annotations

import asyncio
import logging
import struct
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


class PlainOutputsEnded(Exception):
    """The stream ended: the worker's ``OutputsEnd``, or the connection broke (``code``)."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code


class PlainOutputsCall:
    def __init__(self, worker_id: str, address: str, request: worker_pb2.OutputsRequest,
                 fallback: Callable[[], Any]) -> None:
        self.worker_id = worker_id
        self.address = address
        self.request = request
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

    async def __aiter__(self) -> AsyncIterator[worker_pb2.OutputBatch]:
        host, _, port = self.address.rpartition(":")
        try:
            reader, writer = await asyncio.wait_for(
                asyncio.open_connection(host.strip("[]"), int(port)), CONNECT_TIMEOUT_S)
        except (OSError, TimeoutError) as e:
            log.warning("%s: its Outputs port %s is unreachable (%r); reading its Outputs "
                        "RPC instead", self.worker_id, self.address, e)
            self._rpc = self._fallback()
            if self._cancelled:
                self._rpc.cancel()
            async for batch in self._rpc:
                yield batch
            return
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
