"""What one wake-up of a process costs in CPU on this host, by kind: a thread sleeping in
time.sleep, in epoll, an asyncio loop woken by its timer, a grpc.aio server streaming
one small message per wake-up against back to back, and the same over the workers' plain-TCP
Outputs stream (worker/outputs_port.py); and, for scale, what a consumer's gRPC
process does per step in Python, hot (decode one 64-request step message from the engine,
build its router batch, take it). The serving processes' CPU per token at low step rates
follows their wake-ups (bench/RESULTS.md, "The consumer's gRPC process on CPU"); this says
what each costs here.

    python bench/probes/wake_cost_probe.py [--period 0.06] [--n 150]
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import os
import resource
import select
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path[:0] = [ROOT, os.path.join(ROOT, "proto")]


def cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def per_wake(fn, n: int) -> float:  # type: ignore[no-untyped-def]
    c0 = cpu_s()
    for _ in range(n):
        fn()
    return (cpu_s() - c0) / n * 1e6


async def asyncio_sleeps(period: float, n: int) -> float:
    c0 = cpu_s()
    for _ in range(n):
        await asyncio.sleep(period)
    return (cpu_s() - c0) / n * 1e6


def _step_batch():  # type: ignore[no-untyped-def]
    from pdserve.v1 import worker_pb2

    batch = worker_pb2.OutputBatch(seq=1)
    for i in range(64):  # a 64-request step, as a consumer sends one
        t = batch.tokens.add()
        t.request_id = f"cmpl-{i:032x}"
        t.token_ids.append(1000 + i)
        t.text = " tok"
    return batch


def _serve(port: int, period: float, n: int, out: mp.Queue) -> None:  # type: ignore[type-arg]
    import grpc
    from pdserve.v1 import worker_pb2_grpc

    batch = _step_batch()

    class Worker(worker_pb2_grpc.WorkerServicer):
        async def Outputs(self, request, context):  # type: ignore[no-untyped-def]  # noqa: N802
            c0 = cpu_s()
            for _ in range(n):
                yield batch
                if period:
                    await asyncio.sleep(period)
            out.put((cpu_s() - c0) / n * 1e6)

    async def serve() -> None:
        s = grpc.aio.server()
        worker_pb2_grpc.add_WorkerServicer_to_server(Worker(), s)
        s.add_insecure_port(f"127.0.0.1:{port}")
        await s.start()
        await s.wait_for_termination()

    asyncio.run(serve())


def _measured(serve, period: float, n: int, read) -> float:  # type: ignore[no-untyped-def]
    """µs of CPU per message that ``serve`` (its own process, on a free port) spends
    streaming ``n`` of them, while ``read(port)`` reads them all here."""
    from deploy.ports import free_port

    port = free_port("127.0.0.1")
    out: mp.Queue = mp.Queue()  # type: ignore[type-arg]
    p = mp.Process(target=serve, args=(port, period, n, out), daemon=True)
    p.start()
    read(port)
    us = out.get(timeout=60)
    p.terminate()
    return float(us)


def grpc_stream(period: float, n: int) -> float:
    import grpc
    from pdserve.v1 import worker_pb2, worker_pb2_grpc

    async def read(port: int) -> None:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
            req = worker_pb2.OutputsRequest(subscriber_id="probe")
            async for _ in worker_pb2_grpc.WorkerStub(ch).Outputs(req, wait_for_ready=True):
                pass

    return _measured(_serve, period, n, lambda port: asyncio.run(read(port)))


def _serve_plain(port: int, period: float, n: int, out: mp.Queue) -> None:  # type: ignore[type-arg]
    """The worker's plain-TCP Outputs write (worker/outputs_port.py): one frame per period."""
    from worker.outputs_port import batch_frame

    batch = _step_batch()

    async def stream(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.read(1)  # the reader's hello
        c0 = cpu_s()
        for _ in range(n):
            writer.write(batch_frame(batch))
            if period:
                await asyncio.sleep(period)
            else:
                await writer.drain()
        out.put((cpu_s() - c0) / n * 1e6)
        writer.close()

    async def serve() -> None:
        await asyncio.start_server(stream, "127.0.0.1", port)
        await asyncio.sleep(3600)

    asyncio.run(serve())


def plain_stream(period: float, n: int) -> float:
    import socket

    def read(port: int) -> None:
        for _ in range(100):  # until it listens
            try:
                s = socket.create_connection(("127.0.0.1", port))
                break
            except ConnectionRefusedError:
                time.sleep(0.05)
        s.sendall(b"x")
        while s.recv(1 << 16):
            pass
        s.close()

    return _measured(_serve_plain, period, n, read)


def step_work(n: int) -> float:
    """Wall µs per step of the consumer service's own per-step Python, back to back."""
    from worker.messages import decode, encode
    from worker.output_hub import OutputHub
    from worker.token_batch import TokensBatchBuilder

    async def go() -> float:
        hub = OutputHub()
        sub, _ = hub.subscribe("probe")
        rids = [f"cmpl-{i:032x}" for i in range(64)]
        for r in rids:
            hub.attach(r, sub)
        b = TokensBatchBuilder()
        for i, r in enumerate(rids):
            b.add(r, (1234 + i,), " tok", (), None)
        data = encode(b.build())
        t0 = time.perf_counter()
        for _ in range(n):
            hub.add_batch(decode(data))  # type: ignore[arg-type]
            hub.flush()
            await sub.next_batch()
        return (time.perf_counter() - t0) / n * 1e6

    return asyncio.run(go())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--period", type=float, default=0.06, help="seconds between wake-ups")
    ap.add_argument("--n", type=int, default=150)
    a = ap.parse_args()
    ep = select.epoll()
    rows = {
        f"time.sleep({a.period})": per_wake(lambda: time.sleep(a.period), a.n),
        f"epoll.poll({a.period})": per_wake(lambda: ep.poll(a.period), a.n),
        f"asyncio.sleep({a.period})": asyncio.run(asyncio_sleeps(a.period, a.n)),
        f"grpc.aio stream, one message per {a.period} s": grpc_stream(a.period, a.n),
        "grpc.aio stream, back to back": grpc_stream(0.0, a.n * 4),
        f"plain TCP stream (--outputs-port), one message per {a.period} s":
            plain_stream(a.period, a.n),
        "plain TCP stream, back to back": plain_stream(0.0, a.n * 4),
        "a consumer service's step in Python (64 requests, hot, wall)": step_work(2000),
    }
    for name, us in rows.items():
        print(f"{us:8.0f} us   {name}", flush=True)


if __name__ == "__main__":
    main()
