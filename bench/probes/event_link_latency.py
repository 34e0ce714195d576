"""One message, engine process -> gRPC process: how long it takes over a ZMQ PUSH/PULL ipc pair
read from its descriptor on the loop (the events link before session 38) against the Unix
socket of worker/event_link.py read the same way (the link now). A sender process writes a
200-byte message stamped with its send time every millisecond; the reader, on uvloop as a
worker's gRPC process runs, stamps its arrival. Wall clocks of one host.

    python bench/probes/event_link_latency.py [--messages 3000] [--rounds 2]
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import statistics
import time

import uvloop
import zmq

from worker import ipc
from worker.event_link import EventReader, EventWriter, LinkClosed, NothingQueued

PAD = b"x" * 200


def _zmq_sender(endpoint: str, n: int) -> None:
    s = zmq.Context().socket(zmq.PUSH)
    s.connect(endpoint)
    time.sleep(0.5)
    for _ in range(n):
        s.send_multipart([time.time_ns().to_bytes(8, "little"), PAD])
        time.sleep(0.001)
    time.sleep(0.3)


def _link_sender(path: str, n: int) -> None:
    w = EventWriter(path)
    time.sleep(0.5)
    for _ in range(n):
        w.send_multipart([time.time_ns().to_bytes(8, "little"), PAD])
        time.sleep(0.001)
    w.close()


async def _zmq_reader(n: int) -> list[float]:
    endpoint = ipc.IpcPaths.fresh().commands  # any fresh ipc:// endpoint
    s = zmq.Context().socket(zmq.PULL)
    s.bind(endpoint)
    loop = asyncio.get_running_loop()
    lat: list[float] = []
    done = loop.create_future()

    def drain() -> None:  # as worker/servicer.py read it: the descriptor is edge-triggered
        while True:
            try:
                parts = s.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            lat.append((time.time_ns() - int.from_bytes(parts[0], "little")) / 1e3)
            if len(lat) == n and not done.done():
                done.set_result(None)

    fd = s.getsockopt(zmq.FD)
    assert isinstance(fd, int)
    loop.add_reader(fd, drain)
    loop.call_soon(drain)
    p = mp.get_context("spawn").Process(target=_zmq_sender, args=(endpoint, n))
    p.start()
    await done
    loop.remove_reader(fd)
    p.join()
    return lat


async def _link_reader(n: int) -> list[float]:
    paths = ipc.IpcPaths.fresh()
    r = EventReader(paths.events)
    p = mp.get_context("spawn").Process(target=_link_sender, args=(paths.events, n))
    p.start()
    await r.accept()
    loop = asyncio.get_running_loop()
    lat: list[float] = []
    done = loop.create_future()

    def drain() -> None:
        while True:
            try:
                parts = r.recv_multipart()
            except NothingQueued:
                return
            except LinkClosed:
                if not done.done():
                    done.set_result(None)
                return
            lat.append((time.time_ns() - int.from_bytes(parts[0], "little")) / 1e3)

    loop.add_reader(r.fileno(), drain)
    await done
    loop.remove_reader(r.fileno())
    r.close()
    p.join()
    paths.cleanup()
    return lat


def _line(name: str, lat: list[float]) -> str:
    lat = sorted(lat[len(lat) // 10:])  # the first tenth: start-up
    return (f"{name}: {len(lat)} messages, p50 {statistics.median(lat):.1f} µs, "
            f"p90 {lat[int(0.9 * len(lat))]:.1f}, p99 {lat[int(0.99 * len(lat))]:.1f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--messages", type=int, default=3000)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    for _ in range(args.rounds):
        print(_line("zmq ipc   ", uvloop.run(_zmq_reader(args.messages))), flush=True)
        print(_line("event link", uvloop.run(_link_reader(args.messages))), flush=True)


if __name__ == "__main__":
    main()
