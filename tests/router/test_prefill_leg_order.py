"""The router's Prefill stream to a producer (router/requests/producer_leg.py) writes
the request first, whatever comes after it: a destination sent right after the leg starts
(a retried producer, whose consumer had reserved already) used to take the write lock before
the leg's reading task ran, so the producer's first message was the destination and the
stream was half-closed before any request (a scripted-worker test saw it as a request with
no id, about once in fifteen runs)."""

from __future__ import annotations

import asyncio
from typing import Any

import grpc
from pdserve.v1 import common_pb2, worker_pb2

from router.control.registry import WorkerInfo
from router.requests.producer_leg import ProducerLeg


class RecordingCall:
    """A bidi call that records what the leg writes and answers nothing until closed."""

    def __init__(self) -> None:
        self.sent: list[str] = []
        self._ended = asyncio.Event()

    async def write(self, msg: worker_pb2.PrefillInput) -> None:
        await asyncio.sleep(0)  # a real write yields to the loop
        self.sent.append(str(msg.WhichOneof("kind")))

    async def done_writing(self) -> None:
        self.sent.append("half-close")
        self._ended.set()

    async def read(self) -> Any:
        await self._ended.wait()
        return grpc.aio.EOF

    def done(self) -> bool:
        return False

    def cancel(self) -> bool:
        self._ended.set()
        return True


class StreamOnly:
    """A stub whose Prefill is the recording call (no Outputs stream: no StartPrefill)."""

    def __init__(self, call: RecordingCall) -> None:
        self.call = call

    def Prefill(self) -> RecordingCall:  # noqa: N802 - the stub's method name
        return self.call


def _worker() -> WorkerInfo:
    return WorkerInfo("p1", common_pb2.ROLE_PRODUCER, "127.0.0.1:1", "", "m", "", 4096,
                      common_pb2.WorkerLoad(), 0.0)


def test_a_destination_sent_at_once_follows_the_request() -> None:
    async def main() -> None:
        call = RecordingCall()
        leg = ProducerLeg(_worker(), StreamOnly(call), lambda ev: None)  # type: ignore[arg-type]
        leg.start(worker_pb2.PrefillRequest(request_id="r1#retry1"))
        # no turn of the loop in between: the reading task has not run yet
        await leg.send_destination(worker_pb2.KVDestination(consumer_id="c0"))
        assert leg.task is not None
        await asyncio.wait_for(leg.task, 5)
        assert call.sent == ["request", "destination", "half-close"]

    asyncio.run(main())


def test_a_cancelled_leg_leaves_no_writer_waiting() -> None:
    async def main() -> None:
        call = RecordingCall()
        leg = ProducerLeg(_worker(), StreamOnly(call), lambda ev: None)  # type: ignore[arg-type]
        leg.start(worker_pb2.PrefillRequest(request_id="r1"))
        leg.cancel()  # before its reading task ever ran: the request is never written
        await asyncio.wait_for(leg.send_destination(worker_pb2.KVDestination()), 5)
        assert "request" not in call.sent

    asyncio.run(main())
