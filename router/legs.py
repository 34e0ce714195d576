"""The two legs of a request as tasks that turn worker streams into events on one queue.

The dispatcher's state machine then reads a single queue, which keeps ordering questions
(token 0 vs. the consumer's tokens, a transfer failure vs. a dead consumer) in one place.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from enum import Enum, auto
from typing import Any

import grpc
from pdserve.v1 import worker_pb2

from router.registry import WorkerInfo


class Ev(Enum):
    TOKEN0 = auto()  # payload: worker_pb2.Token0
    TRANSFER = auto()  # payload: worker_pb2.TransferResult
    PRODUCER_EOF = auto()  # the producer ended its stream
    TOKENS = auto()  # payload: worker_pb2.Tokens (consumer or colocated)
    DECODE_EOF = auto()  # the consumer/colocated stream ended
    LEG_ERROR = auto()  # payload: (worker, status code or None, message)
    ABORT = auto()  # Router.Abort
    FAIL = auto()  # payload: message (e.g. the worker was dropped by the registry)


@dataclass
class Event:
    kind: Ev
    payload: Any = None


def describe_rpc_error(worker: WorkerInfo, e: BaseException) -> tuple[grpc.StatusCode | None, str]:
    if isinstance(e, grpc.aio.AioRpcError):
        code = e.code()
        return code, (f"{worker.role_name} {worker.worker_id} ({worker.address}) failed: "
                      f"{code.name}: {e.details() or 'no details'}")
    return None, f"{worker.role_name} {worker.worker_id} ({worker.address}) failed: {e!r}"


class ProducerLeg:
    """The bidi Prefill stream: request first, destination when the consumer reserved."""

    def __init__(self, worker: WorkerInfo, call: Any, queue: asyncio.Queue[Event]) -> None:
        self.worker = worker
        self.call = call  # grpc.aio.StreamStreamCall
        self._queue = queue
        self._write_lock = asyncio.Lock()  # grpc.aio allows one outstanding write
        self._closed_writing = False

    async def run(self, request: worker_pb2.PrefillRequest) -> None:
        try:
            await self._write(worker_pb2.PrefillInput(request=request))
            while True:
                out = await self.call.read()
                if out is grpc.aio.EOF:
                    self._queue.put_nowait(Event(Ev.PRODUCER_EOF))
                    return
                kind = out.WhichOneof("kind")
                if kind == "token0":
                    self._queue.put_nowait(Event(Ev.TOKEN0, out.token0))
                elif kind == "transfer":
                    self._queue.put_nowait(Event(Ev.TRANSFER, out.transfer))
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - any failure of the leg ends the request
            await self._report(e)

    async def send_destination(self, dest: worker_pb2.KVDestination) -> None:
        """Forwards the consumer's reservation, then half-closes: nothing else will follow."""
        try:
            await self._write(worker_pb2.PrefillInput(destination=dest))
            await self.half_close()
        except Exception:  # noqa: BLE001 - the read side reports the call's real status
            pass

    async def half_close(self) -> None:
        async with self._write_lock:
            if not self._closed_writing and not self.call.done():
                self._closed_writing = True
                await self.call.done_writing()

    async def _write(self, msg: worker_pb2.PrefillInput) -> None:
        async with self._write_lock:
            if self._closed_writing:
                return
            await self.call.write(msg)

    async def _report(self, e: BaseException) -> None:
        if not isinstance(e, grpc.aio.AioRpcError):
            # A write on a failed call raises a generic error; the call's status says why.
            try:
                code = await asyncio.wait_for(self.call.code(), 1.0)
                details = await self.call.details()
                msg = (f"{self.worker.role_name} {self.worker.worker_id} "
                       f"({self.worker.address}) failed: {code.name}: {details}")
                self._queue.put_nowait(Event(Ev.LEG_ERROR, (self.worker, code, msg)))
                return
            except Exception:  # noqa: BLE001
                pass
        code, msg = describe_rpc_error(self.worker, e)
        self._queue.put_nowait(Event(Ev.LEG_ERROR, (self.worker, code, msg)))


class DecodeLeg:
    """The Decode stream of a consumer (reserved, then tokens) or a colocated worker."""

    def __init__(self, worker: WorkerInfo, call: Any, queue: asyncio.Queue[Event],
                 producer: ProducerLeg | None) -> None:
        self.worker = worker
        self.call = call  # grpc.aio.UnaryStreamCall
        self._queue = queue
        self._producer = producer  # where a reservation is forwarded (None: colocated)

    async def run(self) -> None:
        try:
            async for out in self.call:
                kind = out.WhichOneof("kind")
                if kind == "reserved" and self._producer is not None:
                    dest = worker_pb2.KVDestination(consumer_id=self.worker.worker_id,
                                                    kv_address=out.reserved.kv_address
                                                    or self.worker.kv_address,
                                                    block_ids=out.reserved.block_ids)
                    await self._producer.send_destination(dest)
                elif kind == "tokens":
                    self._queue.put_nowait(Event(Ev.TOKENS, out.tokens))
            self._queue.put_nowait(Event(Ev.DECODE_EOF))
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - any failure of the leg ends the request
            code, msg = describe_rpc_error(self.worker, e)
            self._queue.put_nowait(Event(Ev.LEG_ERROR, (self.worker, code, msg)))
