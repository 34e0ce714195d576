"""How long a transfer thread waits for the GIL while the engine thread launches a step.

A producer's eager step on a GPU host is host launches almost throughout (RESULTS,
"Where a producer's step leaves the host free"): thousands of small torch calls, each of
which drops the GIL around its C++ dispatch and takes it back a few microseconds later.
A thread woken meanwhile (the KV sender's or receiver's I/O thread, whose socket became
readable) rarely wins the GIL in those gaps: CPython hands it over on request only after
the switch interval (``sys.getswitchinterval()``, 5 ms by default) has passed. Every
wake-up of an I/O thread can therefore cost it up to 5 ms.

This probe measures that wait on any host: the main thread plays the launch (small torch
ops on CPU tensors drop and retake the GIL the same way as CUDA launches do), or a pure
Python loop (a scheduler), or sleeps; a second process sends stamped messages at random
times over a ZMQ socket, and a thread blocked in a ZMQ poll (as transfer/io_loop.py's is)
records when its Python code runs again. For each switch interval it prints the wake-up
latency (p50 / p99 / max) and the main thread's work rate; then what a shorter interval
costs the Python loop when an I/O thread with copies in flight wakes every millisecond.

    python bench/probes/gil_wait_probe.py [--intervals-ms 5,1,0.5,0.2] [--n 400]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import random
import statistics
import sys
import threading
import time

import torch
import zmq


def sender(addr: str, n: int, gap_s: float, seed: int) -> None:
    ctx = zmq.Context()
    s = ctx.socket(zmq.PUSH)
    s.connect(addr)
    rng = random.Random(seed)
    time.sleep(0.2)  # the receiver's thread is polling by then
    for _ in range(n):
        time.sleep(rng.uniform(0.5, 1.5) * gap_s)
        s.send(time.perf_counter_ns().to_bytes(8, "little"))
    s.send(b"")
    s.close(linger=1000)
    ctx.term()


def io_thread(sock: zmq.Socket, lat_us: list[float]) -> None:
    poller = zmq.Poller()
    poller.register(sock, zmq.POLLIN)
    while True:
        poller.poll(1000)  # drops the GIL while it waits, as the I/O loop's poll does
        now = time.perf_counter_ns()  # Python runs again: this thread holds the GIL
        try:
            data = sock.recv(zmq.NOBLOCK)
        except zmq.Again:
            continue
        if not data:
            return
        lat_us.append((now - int.from_bytes(data, "little")) / 1e3)


def launch_work(stop: threading.Event) -> int:
    """Small torch calls back to back, as an eager launch makes (each drops the GIL)."""
    x = torch.zeros(4)
    y = torch.ones(4)
    ops = 0
    while not stop.is_set():
        for _ in range(100):
            x = x.add(y)
        ops += 100
    return ops


def python_work(stop: threading.Event) -> int:
    """Pure Python (the scheduler's kind of work): it never drops the GIL itself."""
    ops = 0
    acc = 0
    while not stop.is_set():
        for i in range(1000):
            acc += i * i
        ops += 1000
    return ops


def idle_work(stop: threading.Event) -> int:
    stop.wait()
    return 0


WORKS = {"launch": launch_work, "python": python_work, "idle": idle_work}


def measure(kind: str, interval_s: float, n: int, gap_s: float, seed: int) -> dict[str, float]:
    sys.setswitchinterval(interval_s)
    ctx = zmq.Context()
    sock = ctx.socket(zmq.PULL)
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    lat: list[float] = []
    t = threading.Thread(target=io_thread, args=(sock, lat), daemon=True)
    t.start()
    p = mp.get_context("spawn").Process(target=sender,
                                        args=(f"tcp://127.0.0.1:{port}", n, gap_s, seed))
    p.start()
    stop = threading.Event()
    def end_with_io() -> None:
        t.join()
        stop.set()

    watcher = threading.Thread(target=end_with_io, daemon=True)
    watcher.start()
    t0 = time.perf_counter()
    ops = WORKS[kind](stop)
    wall = time.perf_counter() - t0
    p.join()
    sock.close(linger=0)
    ctx.term()
    sys.setswitchinterval(0.005)
    lat.sort()
    return {"n": len(lat), "p50": statistics.median(lat),
            "p99": lat[min(len(lat) - 1, int(0.99 * len(lat)))], "max": lat[-1],
            "ops_per_s": ops / wall}


def busy_io(stop: threading.Event, period_s: float, work_s: float, turns: list[int]) -> None:
    """A transfer I/O thread with copies in flight: it wakes every period_s (the I/O loop's
    BUSY_POLL_MS) and runs work_s of Python each time."""
    while not stop.is_set():
        time.sleep(period_s)
        end = time.perf_counter() + work_s
        while time.perf_counter() < end:
            pass
        turns[0] += 1


def io_cost(interval_s: float, seconds: float, period_s: float, work_s: float,
            with_io: bool) -> tuple[float, float]:
    """The Python loop's rate beside a busy I/O thread (or alone), and the thread's turns a
    second: what a shorter switch interval costs the engine thread."""
    sys.setswitchinterval(interval_s)
    stop = threading.Event()
    turns = [0]
    t = threading.Thread(target=busy_io, args=(stop, period_s, work_s, turns), daemon=True)
    if with_io:
        t.start()
    timer = threading.Timer(seconds, stop.set)
    timer.start()
    t0 = time.perf_counter()
    ops = python_work(stop)
    wall = time.perf_counter() - t0
    if with_io:
        t.join()
    sys.setswitchinterval(0.005)
    return ops / wall, turns[0] / wall


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--intervals-ms", default="5,1,0.5,0.2")
    ap.add_argument("--works", default="launch,python,idle")
    ap.add_argument("--n", type=int, default=400, help="messages per point")
    ap.add_argument("--gap-ms", type=float, default=4.0, help="mean time between messages")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--io-period-ms", type=float, default=1.0)
    ap.add_argument("--io-work-us", type=float, default=30.0)
    ap.add_argument("--seconds", type=float, default=3.0)
    args = ap.parse_args()
    torch.set_num_threads(1)
    print(f"python {sys.version.split()[0]}, torch {torch.__version__}; {args.n} wake-ups "
          f"a point, ~{args.gap_ms} ms apart; latency = sent -> the woken thread runs (µs)")
    print("| main thread | switch interval ms | p50 µs | p99 µs | max µs | main thread ops/s |")
    print("|---|---|---|---|---|---|")
    for kind in args.works.split(","):
        for ms in (float(v) for v in args.intervals_ms.split(",")):
            r = measure(kind, ms / 1e3, args.n, args.gap_ms / 1e3, args.seed)
            rate = f"{r['ops_per_s']:,.0f}" if kind != "idle" else "-"
            print(f"| {kind} | {ms:g} | {r['p50']:.0f} | {r['p99']:.0f} | {r['max']:.0f} "
                  f"| {rate} |", flush=True)
    print(f"\nThe Python loop beside an I/O thread that wakes every {args.io_period_ms} ms and "
          f"runs {args.io_work_us} µs of Python (copies in flight), {args.seconds} s a point:")
    print("| switch interval ms | loop ops/s alone | loop ops/s beside it | cost | I/O turns/s |")
    print("|---|---|---|---|---|")
    for ms in (float(v) for v in args.intervals_ms.split(",")):
        alone, _ = io_cost(ms / 1e3, args.seconds, 0, 0, with_io=False)
        beside, turns = io_cost(ms / 1e3, args.seconds, args.io_period_ms / 1e3,
                                args.io_work_us / 1e6, with_io=True)
        print(f"| {ms:g} | {alone:,.0f} | {beside:,.0f} | {1 - beside / alone:.1%} "
              f"| {turns:,.0f} |", flush=True)


if __name__ == "__main__":
    main()
