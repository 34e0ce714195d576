"""One grpc.aio channel per worker registration, reused by every request sent to it.

A worker that registers again (a restart, a role change) gets a new channel even at the
same address: the old one may have met the dead process and sit in gRPC's reconnect
backoff, during which every call on it fails at once with UNAVAILABLE ("connection
refused"), for up to its growing backoff, though the new process already listens. Each
channel keeps its own subchannels for the same reason: by default gRPC shares one per
address across the process's channels, so a new channel would inherit a closing one's
backoff."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import grpc
from pdserve.v1 import worker_pb2_grpc

from router.control.registry import WorkerInfo
from router.requests.worker_outputs import WorkerOutputs

# Prompts travel as token ids; a 1M-token prompt is ~5 MB on the wire, above gRPC's 4 MB
# default, so raise the cap well past any max_model_len a worker will accept.
MAX_MESSAGE_BYTES = 64 << 20
CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.use_local_subchannel_pool", 1),
]


# gRPC metadata key of the cluster token on every call to a worker (worker/servicer.py
# checks it; the router must not import that package, so the name is written in both)
CLUSTER_TOKEN_METADATA = "x-pdserve-cluster-token"


class _Token:
    """Adds the cluster token to a call's metadata: workers refuse calls without it."""

    def __init__(self, token: str) -> None:
        self.pair = (CLUSTER_TOKEN_METADATA, token)

    def details(self, d: Any) -> Any:
        return d._replace(metadata=grpc.aio.Metadata(*(d.metadata or ()), self.pair))


# grpc.aio files an interceptor under the first call kind it implements only: one class each
class _TokenUnaryUnary(_Token, grpc.aio.UnaryUnaryClientInterceptor):
    async def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
        return await continuation(self.details(details), request)


class _TokenUnaryStream(_Token, grpc.aio.UnaryStreamClientInterceptor):
    async def intercept_unary_stream(self, continuation: Any, details: Any, request: Any) -> Any:
        return await continuation(self.details(details), request)


class _TokenStreamStream(_Token, grpc.aio.StreamStreamClientInterceptor):
    async def intercept_stream_stream(self, continuation: Any, details: Any,
                                      request_iterator: Any) -> Any:
        return await continuation(self.details(details), request_iterator)


class WorkerChannels:
    def __init__(self, close_delay_s: float = 0.0, cluster_token: str = "") -> None:
        self._interceptors: list[Any] = [
            k(cluster_token) for k in (_TokenUnaryUnary, _TokenUnaryStream, _TokenStreamStream)
        ] if cluster_token else []
        # A dropped worker's channel stays open this long so the Worker.Abort calls of its
        # requests (sent after the drop fails them) can still reach a worker that is alive.
        self._close_delay_s = close_delay_s
        self._token = cluster_token  # in the plain-TCP Outputs stream's request
        # worker id -> (the registration it was opened for, its channel, its stub)
        self._channels: dict[str, tuple[WorkerInfo, grpc.aio.Channel,
                                        worker_pb2_grpc.WorkerStub]] = {}
        self._outputs: dict[str, WorkerOutputs] = {}  # worker id -> its Outputs stream
        self._closing: set[asyncio.Task[None]] = set()

    def outputs(self, w: WorkerInfo) -> WorkerOutputs:
        """The worker's Outputs stream on its current channel, opened (again) if needed."""
        stub = self.stub(w)
        out = self._outputs.get(w.worker_id)
        if out is None or not out.usable:
            out = WorkerOutputs(w.worker_id, stub, w.outputs_address, self._token,
                                outputs_unix=w.outputs_unix)
            self._outputs[w.worker_id] = out
        return out

    def outputs_transport(self, worker_id: str) -> str:
        """"unix", "tcp" or "grpc": how the worker's open Outputs stream is read; "": none
        open."""
        out = self._outputs.get(worker_id)
        return out.transport if out is not None and out.usable else ""

    def _close_outputs(self, worker_id: str) -> None:
        out = self._outputs.pop(worker_id, None)
        if out is not None:
            out.close()

    def stub(self, w: WorkerInfo) -> worker_pb2_grpc.WorkerStub:
        """The channel of ``w``'s registration; a newer registration replaces an older one's
        channel (and its Outputs stream). A call for an older registration than the
        channel's (an abort for a request of the process that was replaced) rides the
        current channel: the old process is gone, and an abort of an id the new one does not
        hold is answered and ignored."""
        entry = self._channels.get(w.worker_id)
        if entry is not None and w.incarnation <= entry[0].incarnation:
            return entry[2]
        if entry is not None:  # registered again: the old channel may be in backoff
            self._close_outputs(w.worker_id)
            self._close_later(entry[1])
        channel = grpc.aio.insecure_channel(w.address, options=CHANNEL_OPTIONS,
                                            interceptors=self._interceptors)
        stub = worker_pb2_grpc.WorkerStub(channel)
        self._channels[w.worker_id] = (w, channel, stub)
        return stub

    def drop(self, worker_id: str) -> None:
        """Forgets a worker's channel; calls still on it are cancelled by the close."""
        entry = self._channels.pop(worker_id, None)
        if entry is not None:
            self._close_outputs(worker_id)
            self._close_later(entry[1])

    async def close(self) -> None:
        for worker_id in list(self._outputs):
            self._close_outputs(worker_id)
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
