"""One grpc.aio channel per worker, reused by every request sent to it."""

from __future__ import annotations

import asyncio
import contextlib

import grpc
from pdserve.v1 import worker_pb2_grpc

# Prompts travel as token ids; a 1M-token prompt is ~5 MB on the wire, above gRPC's 4 MB
# default, so raise the cap well past any max_model_len a worker will accept.
MAX_MESSAGE_BYTES = 64 << 20
CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
]


class WorkerChannels:
    def __init__(self, close_delay_s: float = 0.0) -> None:
        # A dropped worker's channel stays open this long so the Worker.Abort calls of its
        # requests (sent after the drop fails them) can still reach a worker that is alive.
        self._close_delay_s = close_delay_s
        self._channels: dict[str, tuple[str, grpc.aio.Channel, worker_pb2_grpc.WorkerStub]] = {}
        self._closing: set[asyncio.Task[None]] = set()

    def stub(self, worker_id: str, address: str) -> worker_pb2_grpc.WorkerStub:
        entry = self._channels.get(worker_id)
        if entry is not None and entry[0] == address:
            return entry[2]
        if entry is not None:  # the worker came back at another address
            self._close_later(entry[1])
        channel = grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS)
        stub = worker_pb2_grpc.WorkerStub(channel)
        self._channels[worker_id] = (address, channel, stub)
        return stub

    def drop(self, worker_id: str) -> None:
        """Forgets a worker's channel; calls still on it are cancelled by the close."""
        entry = self._channels.pop(worker_id, None)
        if entry is not None:
            self._close_later(entry[1])

    async def close(self) -> None:
        for _, channel, _ in self._channels.values():
            await channel.close(grace=None)
        self._channels.clear()
        for t in list(self._closing):
            t.cancel()
            with contextlib.suppress(BaseException):
                await t

    async def _close(self, channel: grpc.aio.Channel) -> None:
        try:
            await asyncio.sleep(self._close_delay_s)
        finally:
            await channel.close(grace=None)

    def _close_later(self, channel: grpc.aio.Channel) -> None:
        # Registry callbacks are synchronous; closing a channel is not.
        task = asyncio.get_running_loop().create_task(self._close(channel))
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)
