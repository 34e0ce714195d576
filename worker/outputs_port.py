"""The worker's plain Outputs stream (TCP, and a same-host Unix socket): the router's per-step
batches, one write each.

The ``Outputs`` RPC (worker/servicer.py) carries the same batches, but grpc.aio completes
each write on its own poller thread and then wakes the event loop for it: two wake-ups of
this process per engine step (the step's message from the engine, then the write's
completion), and at a consumer's step rates each wake-up, not the Python around it, is most
of the process's CPU per token (bench/RESULTS.md, "The consumer's gRPC process on CPU";
``bench/probes/wake_cost_probe.py`` measures a grpc.aio stream against this one). Here a
batch is one ``transport.write`` inside the step message's own wake-up (the hub's flush
writes it through ``DirectSink`` while the stream's task is parked): the socket takes it at
once, and nothing comes back to wake the loop.

Two listeners serve the one protocol below through the same code: the TCP port any router
can reach, and (Linux) an abstract Unix socket whose name has an unguessable random part.
Abstract names belong to a network namespace, so only a router on this host (and in this
namespace) reaches the socket; it reads that one, because a loopback TCP send runs much of
the reader's network stack inside this process's write: one 3 KB write every 50 ms costs
the writer 79-84 µs of CPU over TCP and 47 µs over the Unix socket
(``bench/probes/uds_write_probe.py``). In a whole cluster that is ~0.6 µs of the consumer
service's ~14.5 µs of CPU per token at 64 tokens a step (bench/RESULTS.md, "The Outputs
stream over a Unix socket"). Anyone in the
namespace can connect to an abstract name (it has no file permissions), so the hello's
token check guards it exactly as it guards the port.

Wire (worker.proto, ``OutputsFrame``): every message either way is a 4-byte big-endian
length and then the protobuf. The router sends one ``OutputsRequest`` (with the cluster
token); the worker answers with frames, an empty batch first (subscribed: StartDecode calls
may name it), then one per queued step, until an ``OutputsEnd`` (a gRPC status code and
why) or the connection closes.

Lifecycle of one connection (who moves it):

    HELLO ──a valid OutputsRequest within HELLO_TIMEOUT_S──▶ STREAMING ──▶ CLOSED
      │ anything else (too long, not an OutputsRequest,       │ the router closed it, the hub
      │ wrong token, bad subscriber id, silence):             │ failed (OutputsEnd UNAVAILABLE),
      ▼ OutputsEnd naming the field, then CLOSED              ▼ or the worker stops

A subscriber whose connection closes hands back its requests, which are aborted (their
reader is gone), exactly as when the RPC ends. A router that reads slower than steps come
gets its queued steps merged into its next batch (worker/output_hub.py) while the write
waits for the socket to drain, so memory stays bounded by the requests, not the steps.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import socket
import struct
import uuid
from collections.abc import Callable
from typing import Any

import grpc
from google.protobuf.message import DecodeError
from pdserve.v1 import worker_pb2

from worker.output_hub import OutputHub, Subscriber, SubscriberFailed

log = logging.getLogger(__name__)

# How long stop() lets the streams write what is queued (the RPC's server.stop grace)
STOP_GRACE_S = 1.0
HELLO_TIMEOUT_S = 10.0  # a connection that sends no OutputsRequest by then is closed
MAX_HELLO = 4096  # bytes of the OutputsRequest: a subscriber id (<= 256) and a token
# The transport's write buffer above which a write waits for the socket to drain (the hub
# merges the steps that come meanwhile); a 256-request step is ~20 KB.
HIGH_WATER = 1 << 20
_LEN = struct.Struct(">I")
# OutputsFrame's ``batch`` field (number 1, length-delimited): a serialized OutputBatch
# behind this tag and its length is that frame, without copying the batch into a wrapper.
_BATCH_TAG = b"\x0a"
# The abstract Unix socket's name (after its NUL byte) starts with this, then a uuid4: a
# name nobody else binds by chance, and no one guesses to squat on before the worker binds.
UNIX_PREFIX = "pdserve-outputs-"


def _varint(n: int) -> bytes:
    out = bytearray()
    while n > 0x7F:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def batch_frame(batch: worker_pb2.OutputBatch) -> bytes:
    """The length-prefixed ``OutputsFrame`` carrying ``batch``."""
    data = batch.SerializeToString()
    body = _BATCH_TAG + _varint(len(data))
    return _LEN.pack(len(body) + len(data)) + body + data


def end_frame(code: grpc.StatusCode, message: str) -> bytes:
    body = worker_pb2.OutputsFrame(end=worker_pb2.OutputsEnd(
        code=code.value[0], message=message)).SerializeToString()
    return _LEN.pack(len(body)) + body


class DirectSink:
    """A stream's socket as the hub's ``Sink``: a batch is one ``transport.write``, taken
    while the buffer is at or under HIGH_WATER (past it the writer task waits for the
    drain, and the hub merges the steps that come meanwhile)."""

    def __init__(self, writer: asyncio.StreamWriter) -> None:
        self.transport = writer.transport

    def ready(self) -> bool:
        t = self.transport
        return not t.is_closing() and t.get_write_buffer_size() <= HIGH_WATER

    def write(self, batch: worker_pb2.OutputBatch) -> None:
        self.transport.write(batch_frame(batch))


class HelloRefused(Exception):
    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code


class OutputsPort:
    """The listener; ``orphaned`` aborts the requests a closed stream hands back."""

    def __init__(self, hub: OutputHub, cluster_token: str,
                 orphaned: Callable[[list[str], str], None],
                 failed: Callable[[], str | None]) -> None:
        self.hub = hub
        self.cluster_token = cluster_token
        self.orphaned = orphaned
        self.failed = failed  # the engine's fatal error (None or "": none)
        self.servers: list[asyncio.AbstractServer] = []  # the TCP and Unix listeners
        self.streams: set[asyncio.Task[None]] = set()
        # the streams past their hello: what each reads and writes to (stop() flushes them)
        self.live: dict[asyncio.Task[None], tuple[Subscriber, asyncio.StreamWriter]] = {}
        self.refused = 0  # connections closed at their hello (tests, logs)
        self.port = 0  # where it listens, once started
        self.unix_name = ""  # its abstract Unix socket ("@" for the NUL byte), once started

    async def start(self, host: str, port: int) -> int:
        server = await asyncio.start_server(self._serve, host, port)
        self.servers.append(server)
        self.port = int(server.sockets[0].getsockname()[1])
        return self.port

    async def start_unix(self) -> str:
        """Listens on a fresh abstract Unix socket too (Linux); returns its name as the router
        is told it, with "@" for the leading NUL byte. Raises OSError where the platform has
        no abstract names."""
        name = UNIX_PREFIX + uuid.uuid4().hex
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            # bound here, not by start_unix_server(path): an abstract name leaves no file
            # behind to clean up, and asyncio's and uvloop's path handling differ for it
            sock.bind("\0" + name)
            server = await asyncio.start_unix_server(self._serve, sock=sock)
        except BaseException:
            sock.close()
            raise
        self.servers.append(server)
        self.unix_name = "@" + name
        return self.unix_name

    async def stop(self, grace_s: float = STOP_GRACE_S) -> None:
        """Closes the listener, lets the streams write what the hub queued for them (up to
        ``grace_s``: a drained worker's last tokens are in flight), then ends them."""
        for server in self.servers:
            server.close()
        loop = asyncio.get_running_loop()
        end = loop.time() + grace_s
        while self._unsent() and loop.time() < end:
            await asyncio.sleep(0.01)
        for t in list(self.streams):
            t.cancel()
        if self.streams:
            await asyncio.gather(*self.streams, return_exceptions=True)

    def _unsent(self) -> bool:
        """Some stream has a batch queued or bytes not yet taken by its socket."""
        return any(sub.has_queued or writer.transport.get_write_buffer_size()
                   for sub, writer in self.live.values())

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self.streams.add(task)
        # a Unix socket's client is unnamed: its peername is empty
        peer: Any = writer.get_extra_info("peername") or "a Unix socket client"
        try:
            try:
                request = await asyncio.wait_for(self._hello(reader), HELLO_TIMEOUT_S)
            except TimeoutError:
                raise HelloRefused(grpc.StatusCode.DEADLINE_EXCEEDED,
                                   f"no OutputsRequest within {HELLO_TIMEOUT_S:g} s") from None
            await self._stream(request, reader, writer)
        except HelloRefused as e:
            self.refused += 1
            log.warning("refused an Outputs connection from %s: %s", peer, e)
            with contextlib.suppress(ConnectionError):
                writer.write(end_frame(e.code, str(e)))
        except (ConnectionError, asyncio.IncompleteReadError):
            pass  # the router went away: the stream ends as if it closed it
        except asyncio.CancelledError:
            # stop(): ended here, since asyncio's stream server (3.11) reads the exception
            # of a connection task that ends cancelled and logs the CancelledError it gets
            task.uncancel()
        finally:
            self.streams.discard(task)
            writer.close()

    async def _hello(self, reader: asyncio.StreamReader) -> worker_pb2.OutputsRequest:
        try:
            (n,) = _LEN.unpack(await reader.readexactly(_LEN.size))
        except asyncio.IncompleteReadError:
            raise HelloRefused(grpc.StatusCode.INVALID_ARGUMENT,
                               "OutputsRequest: the connection closed before it") from None
        if n > MAX_HELLO:
            raise HelloRefused(grpc.StatusCode.RESOURCE_EXHAUSTED,
                               f"OutputsRequest: {n} bytes, more than {MAX_HELLO}")
        try:
            request = worker_pb2.OutputsRequest.FromString(await reader.readexactly(n))
        except asyncio.IncompleteReadError:
            raise HelloRefused(grpc.StatusCode.INVALID_ARGUMENT,
                               "OutputsRequest: the connection closed inside it") from None
        except DecodeError as e:
            raise HelloRefused(grpc.StatusCode.INVALID_ARGUMENT,
                               f"OutputsRequest: not a valid message: {e}") from None
        if self.cluster_token and not hmac.compare_digest(
                request.cluster_token.encode(), self.cluster_token.encode()):
            raise HelloRefused(grpc.StatusCode.UNAUTHENTICATED,
                               "cluster_token: wrong or missing cluster token")
        if fatal := self.failed():
            raise HelloRefused(grpc.StatusCode.UNAVAILABLE, fatal)
        return request

    async def _stream(self, request: worker_pb2.OutputsRequest,
                      reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            sub, replaced = self.hub.subscribe(request.subscriber_id)
        except ValueError as e:
            raise HelloRefused(grpc.StatusCode.INVALID_ARGUMENT, str(e)) from None
        self.orphaned(replaced, "its router opened a new Outputs stream")
        sock = writer.get_extra_info("socket")
        if sock is not None and sock.family != socket.AF_UNIX:
            # a router host that vanishes without a reset is found too (on one host, the
            # kernel closes a Unix socket's peer when its process dies)
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        writer.transport.set_write_buffer_limits(high=HIGH_WATER)
        # The router sends nothing after its hello: a read returns only when it closes
        # (or breaks the protocol), and then ends the stream. Until then it costs nothing:
        # no wake-up, and no second future to wait on beside each step's batch.
        me = asyncio.current_task()
        assert me is not None
        closed = asyncio.ensure_future(reader.read(1))

        def on_closed(_: asyncio.Future[bytes]) -> None:
            me.cancel()

        closed.add_done_callback(on_closed)
        self.live[me] = (sub, writer)
        sink = DirectSink(writer)
        try:
            writer.write(batch_frame(worker_pb2.OutputBatch(seq=0)))
            while True:
                # Parked: the hub writes each step's batch itself, inside the flush that
                # queued it; this task wakes only for what the sink declined (a socket
                # past HIGH_WATER) and for the hub's failure.
                sub.sink = sink
                try:
                    batch = await sub.next_batch()
                except SubscriberFailed as e:  # every request on it ended with this
                    writer.write(end_frame(grpc.StatusCode.UNAVAILABLE, str(e)))
                    return
                finally:
                    sub.sink = None
                writer.write(batch_frame(batch))
                await writer.drain()  # waits only past HIGH_WATER (the transport's limit)
        except asyncio.CancelledError:
            if not closed.done():
                raise  # the worker stops
            me.uncancel()  # the router closed the connection: the stream ends here
        finally:
            self.live.pop(me, None)
            closed.remove_done_callback(on_closed)
            closed.cancel()
            self.orphaned(self.hub.unsubscribe(sub), "its router's Outputs stream ended")
