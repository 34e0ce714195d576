"""The floor under the router's per-token CPU: bare grpc.aio server streaming, one message
per stream per tick, nothing else in the process.

A server process serves ``pdserve.v1.Router/Generate`` with a handler that only waits for
a shared tick (like a run waiting for its worker's next step) and sends one small
``GenerateResponse`` (one token id, a short text) per tick per stream; a client process
holds N streams open over one channel (as a client process of bench/serving_cpu_bench.py
does). The server's CPU (utime + stime from /proc) over the run, divided by the messages
sent, is what grpc.aio itself costs per streamed message on this machine: the router pays
it per client message on top of its own work, so it bounds how low the router's CPU per
token can go while each message carries one token.

    python bench/grpc_stream_floor.py --streams 64 --tick-ms 10 --messages 300 \
        --repeat 3 --out OUT.json

``--mode write`` sends with ``context.write`` from a coroutine handler instead of yielding
from an async generator (the router's way); ``--mode bytes`` yields each message already
encoded to a method registered without a response serializer (no protobuf object per
message); ``--mode driven`` starts every stream's write from the tick itself, driving
``context.write`` by hand (router/requests/direct_write.py, the router's steady state): no
handler task wakes per message; ``--mode sync`` serves from grpc's sync server, one pool
thread per stream;
``--mode serialized`` builds the protobuf message and calls ``SerializeToString`` once
in the handler, handing the bytes to a generic handler with identity serializers;
``--mode sse`` is the HTTP door's shape instead of gRPC: an aiohttp server streaming one
OpenAI-style ``data: {json}`` chunk per tick per stream (HTTP/1.1, one connection per
stream), read by aiohttp clients; ``--server-option NAME=VALUE`` passes a grpc server
channel argument (ints where they parse), to measure options against the default;
``--loop uvloop`` runs the server's event loop on uvloop instead of asyncio's own;
``--mode h2`` serves gRPC without grpc: an asyncio protocol whose connection setup and
control frames go through the ``h2`` package, and whose response messages are written by
hand as HTTP/2 DATA frames (9-byte frame header, 5-byte gRPC prefix, the message's protobuf
bytes) within the peer's flow-control windows, one transport write per message, read by
the same grpcio client; ``--mode h2-coalesce`` joins a tick's frames for every stream of a
connection into one transport write.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import datetime
import json
import multiprocessing as mp
import os
import platform
import sys
import threading
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
    sys.path.insert(1, os.path.join(ROOT, "proto"))

import grpc  # noqa: E402
from pdserve.v1 import router_pb2, router_pb2_grpc  # noqa: E402

from deploy.benchmark.proc_cpu import proc_cpu_s  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from h2_floor_server import _field, _varint, serve_h2  # noqa: E402


class TickServicer(router_pb2_grpc.RouterServicer):
    """Yields its responses (an async generator handler, as the router's Generate)."""

    def __init__(self, messages: int) -> None:
        self.messages = messages
        self.tick = asyncio.Event()

    def step(self) -> None:
        tick, self.tick = self.tick, asyncio.Event()
        tick.set()

    async def responses(self, rid: str) -> AsyncIterator[router_pb2.GenerateResponse]:
        for i in range(self.messages):
            await self.tick.wait()
            yield router_pb2.GenerateResponse(request_id=rid, token_ids=[1000 + i],
                                              text=" tok")

    async def Generate(self, request: router_pb2.GenerateRequest,  # type: ignore[override]
                       context: Any) -> AsyncIterator[router_pb2.GenerateResponse]:
        async for resp in self.responses(request.request_id):
            yield resp


class WritingTickServicer(TickServicer):
    """Writes its responses with ``context.write`` (a coroutine handler)."""

    async def Generate(self, request: router_pb2.GenerateRequest,  # type: ignore[override]
                       context: Any) -> None:
        async for resp in self.responses(request.request_id):
            await context.write(resp)


class DrivenTickServicer(TickServicer):
    """The tick itself starts every stream's write: each stream's ``context.write``
    coroutine is driven by hand from the tick callback (``DirectWrite``), so no handler
    task wakes per message; the handler only waits for its stream's end."""

    def __init__(self, messages: int) -> None:
        super().__init__(messages)
        self.streams: list[Any] = []

    def step(self) -> None:
        for st in self.streams:
            st.send()

    async def Generate(self, request: router_pb2.GenerateRequest,  # type: ignore[override]
                       context: Any) -> None:
        from router.requests.direct_write import DirectWrite

        rid = request.request_id
        done = asyncio.get_running_loop().create_future()
        writer = DirectWrite(context)
        sent = 0

        class Stream:
            @staticmethod
            def send() -> None:
                nonlocal sent
                if sent >= self.messages:
                    if not done.done():
                        done.set_result(None)
                    return
                if writer.idle:
                    writer.start(router_pb2.GenerateResponse(
                        request_id=rid, token_ids=[1000 + sent], text=" tok"))
                    sent += 1

        st = Stream()
        self.streams.append(st)
        try:
            await done
            await writer.wait_idle()
        finally:
            self.streams.remove(st)


class BytesTickServicer(TickServicer):
    """Yields each response already encoded (protobuf wire bytes written here, the same
    message as the other modes) to a method registered with no response serializer: no
    protobuf object is built or serialized per message."""

    async def bytes_responses(self, request: router_pb2.GenerateRequest, context: Any
                              ) -> AsyncIterator[bytes]:
        head = _field(0x0A, request.request_id.encode())  # request_id = 1
        tail = _field(0x1A, b" tok")  # text = 3
        for i in range(self.messages):
            await self.tick.wait()
            yield head + _field(0x12, _varint(1000 + i)) + tail  # token_ids = 2, packed


class SerializedTickServicer(TickServicer):
    """Builds each response as the other modes do, serializes it once in the handler and
    hands the bytes over raw (identity response serializer): grpc does no serializing."""

    async def bytes_responses(self, request: router_pb2.GenerateRequest, context: Any
                              ) -> AsyncIterator[bytes]:
        rid = request.request_id
        for i in range(self.messages):
            await self.tick.wait()
            yield router_pb2.GenerateResponse(request_id=rid, token_ids=[1000 + i],
                                              text=" tok").SerializeToString()


def _add_bytes_servicer(servicer: BytesTickServicer | SerializedTickServicer,
                        server: Any) -> None:
    generate = grpc.unary_stream_rpc_method_handler(
        servicer.bytes_responses,
        request_deserializer=router_pb2.GenerateRequest.FromString,
        response_serializer=None)  # the handler's bytes go out as they are
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
        "pdserve.v1.Router", {"Generate": generate}),))


class SyncTickServicer(router_pb2_grpc.RouterServicer):
    """grpc's sync server: one pool thread per stream, each waiting on a shared tick."""

    def __init__(self, messages: int) -> None:
        self.messages = messages
        self.cond = threading.Condition()
        self.ticks = 0

    def step(self) -> None:
        with self.cond:
            self.ticks += 1
            self.cond.notify_all()

    def Generate(self, request: router_pb2.GenerateRequest,  # type: ignore[override]
                 context: Any) -> Iterator[router_pb2.GenerateResponse]:
        with self.cond:
            seen = self.ticks
        for i in range(self.messages):
            with self.cond:
                self.cond.wait_for(lambda: self.ticks > seen)  # noqa: B023 - read now
                seen = self.ticks
            yield router_pb2.GenerateResponse(request_id=request.request_id,
                                              token_ids=[1000 + i], text=" tok")


def _serve_sync(port_q: Any, messages: int, tick_s: float, streams: int,
                options: list[tuple[str, Any]]) -> None:
    server = grpc.server(concurrent.futures.ThreadPoolExecutor(max_workers=streams + 4),
                         options=options)
    servicer = SyncTickServicer(messages)
    router_pb2_grpc.add_RouterServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    port_q.put(port)
    while True:
        time.sleep(tick_s)
        servicer.step()


SSE_CHUNK = {"id": "cmpl-0", "object": "text_completion", "created": 0, "model": "m",
             "choices": [{"index": 0, "text": " tok", "logprobs": None,
                          "finish_reason": None}]}


async def _serve_sse(port_q: Any, messages: int, tick_s: float) -> None:
    """The HTTP door's per-chunk work: one JSON chunk encoded and written per tick."""
    from aiohttp import web

    tick = asyncio.Event()

    async def stream(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                           "Cache-Control": "no-cache"})
        await resp.prepare(request)
        for i in range(messages):
            await tick.wait()
            chunk = dict(SSE_CHUNK, id=f"cmpl-{i}")
            await resp.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    app = web.Application()
    app.router.add_post("/v1/completions", stream)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port_q.put(site._server.sockets[0].getsockname()[1])  # type: ignore[union-attr]
    while True:
        await asyncio.sleep(tick_s)
        tick, old = asyncio.Event(), tick
        old.set()


async def _serve(port_q: Any, messages: int, tick_s: float, mode: str,
                 options: list[tuple[str, Any]]) -> None:
    if mode == "sse":
        await _serve_sse(port_q, messages, tick_s)
        return
    if mode in ("h2", "h2-coalesce"):
        await serve_h2(port_q, messages, tick_s, coalesce=mode == "h2-coalesce")
        return
    server = grpc.aio.server(options=options)
    servicer = {"yield": TickServicer, "write": WritingTickServicer,
                "bytes": BytesTickServicer, "driven": DrivenTickServicer,
                "serialized": SerializedTickServicer}[mode](messages)
    if isinstance(servicer, BytesTickServicer | SerializedTickServicer):
        _add_bytes_servicer(servicer, server)
    else:
        router_pb2_grpc.add_RouterServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    port_q.put(port)
    while True:
        await asyncio.sleep(tick_s)
        servicer.step()


def server_main(port_q: Any, messages: int, tick_s: float, mode: str, streams: int,
                options: list[tuple[str, Any]], loop: str = "asyncio") -> None:
    if mode == "sync":
        _serve_sync(port_q, messages, tick_s, streams, options)
    elif loop == "uvloop":
        import uvloop

        uvloop.run(_serve(port_q, messages, tick_s, mode, options))
    else:
        asyncio.run(_serve(port_q, messages, tick_s, mode, options))


async def _sse_clients(port: int, streams: int) -> int:
    import aiohttp

    url = f"http://127.0.0.1:{port}/v1/completions"
    async with aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=streams)) as session:

        async def one(i: int) -> int:
            n = 0
            async with session.post(url, json={"prompt": str(i)}) as resp:
                async for line in resp.content:
                    if line.startswith(b"data: {"):
                        n += 1
            return n

        return sum(await asyncio.gather(*(one(i) for i in range(streams))))


async def _clients(port: int, streams: int) -> int:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = router_pb2_grpc.RouterStub(channel)

        async def one(i: int) -> int:
            n = 0
            async for _ in stub.Generate(router_pb2.GenerateRequest(request_id=str(i))):
                n += 1
            return n

        return sum(await asyncio.gather(*(one(i) for i in range(streams))))


def one_run(args: argparse.Namespace, options: list[tuple[str, Any]]) -> dict[str, Any]:
    ctx = mp.get_context("spawn")
    port_q = ctx.Queue()
    server = ctx.Process(target=server_main, args=(port_q, args.messages, args.tick_ms / 1e3,
                                                   args.mode, args.streams, options,
                                                   args.loop))
    server.start()
    try:
        port = port_q.get(timeout=30)
        time.sleep(0.5)  # the server settled: its start-up is not measured
        assert server.pid is not None
        cpu0, t0 = proc_cpu_s(server.pid) or 0.0, time.monotonic()
        sent = asyncio.run((_sse_clients if args.mode == "sse" else _clients)(
            port, args.streams))
        cpu1, t1 = proc_cpu_s(server.pid) or 0.0, time.monotonic()
    finally:
        server.kill()
        server.join()
    cpu_s = cpu1 - cpu0
    return {"messages": sent, "wall_s": round(t1 - t0, 3), "server_cpu_s": round(cpu_s, 3),
            "server_us_per_message": round(cpu_s / sent * 1e6, 1),
            "messages_per_s": round(sent / (t1 - t0), 1)}


def _option(text: str) -> tuple[str, Any]:
    name, _, value = text.partition("=")
    try:
        return name, int(value)
    except ValueError:
        return name, value


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--streams", type=int, default=64)
    ap.add_argument("--tick-ms", type=float, default=10.0)
    ap.add_argument("--messages", type=int, default=300, help="per stream")
    ap.add_argument("--mode", choices=("yield", "write", "bytes", "sync", "driven",
                                       "serialized", "sse", "h2", "h2-coalesce"),
                    default="yield")
    ap.add_argument("--loop", choices=("asyncio", "uvloop"), default="asyncio",
                    help="the server's event loop")
    ap.add_argument("--server-option", action="append", default=[], type=_option)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--out", help="JSON results here")
    args = ap.parse_args()
    runs = [one_run(args, args.server_option) for _ in range(args.repeat)]
    per_msg = sorted(r["server_us_per_message"] for r in runs)
    result = {
        "tool": "bench/grpc_stream_floor.py", "command": sys.argv,
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(),
                    "load_avg": os.getloadavg()},
        "grpc": grpc.__version__, "config": {k: v for k, v in vars(args).items()
                                             if k != "out"},
        "runs": runs, "server_us_per_message_median": per_msg[len(per_msg) // 2]}
    print(f"{args.mode} ({args.loop}), {args.streams} streams, {args.tick_ms:g} ms ticks: server "
          f"µs/message {per_msg} (median {result['server_us_per_message_median']})")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
