"""How fast this host runs the serving path's kind of work, in two lines for host.txt.

Two GPU machines of one kind gave first-token holds 2x apart in every stage (bench/RESULTS.md,
session 39), and ``lscpu`` named the same CPU model on both. The hold is Python on one core
at a time: object churn, dict lookups, small protobuf messages and a wake-up through a
socket. This times each of those (median of several rounds).

One process's Python speed on these VMs is bimodal: on this 2-core VM successive processes
took about 20 or about 40 ms for the same dict-and-string loop (protobuf alike, 10 or 19),
steady within each process; how many drew the slow speed changed over time (cause not
found; bench/RESULTS.md, session 39). So the timings run in several fresh processes, and
the line gives their least, median and most: the least is the host, the spread is the
processes'.

    python bench/probes/host_speed.py [--processes 5]
"""

from __future__ import annotations

import os
import socket
import statistics
import sys
import threading
import time
from collections.abc import Callable

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path[:0] = [ROOT, os.path.join(ROOT, "proto")]

ROUNDS = 7


def _median_ms(fn: Callable[[], None], rounds: int = ROUNDS) -> float:
    times = []
    for _ in range(rounds):
        t = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times)


def python_work() -> None:
    """Object churn and dict traffic, the shape of a router's per-token work."""
    d: dict[str, list[int]] = {}
    for i in range(100_000):
        key = f"req-{i & 1023}"
        d.setdefault(key, []).append(i)
        if len(d[key]) > 8:
            d[key] = d[key][-2:]


def protobuf_work() -> None:
    from pdserve.v1 import worker_pb2

    for i in range(5_000):
        b = worker_pb2.OutputBatch(seq=i)
        t = b.tokens.add(request_id=f"req-{i}")
        t.token_ids.extend((i, i + 1))
        worker_pb2.OutputBatch.FromString(b.SerializeToString())


def wake_us(n: int = 2_000) -> float:
    """Median one-way time of a small message through a Unix socket pair to a thread
    blocked in recv: a wake-up through the kernel, as between the serving processes."""
    a, b = socket.socketpair()
    got: list[int] = []

    def reader() -> None:
        for _ in range(n):
            msg = b.recv(20, socket.MSG_WAITALL)  # one message, never two merged
            got.append(time.perf_counter_ns() - int(msg))

    th = threading.Thread(target=reader)
    th.start()
    for _ in range(n):
        a.send(str(time.perf_counter_ns()).encode().ljust(20))
        time.sleep(0.0002)
    th.join()
    a.close()
    b.close()
    return statistics.median(got) / 1e3


def cpu_shares(window_s: float = 1.0) -> str:
    """The host's CPUs over ``window_s`` from /proc/stat: busy (user, system, irq) and stolen
    (taken by the hypervisor for other guests), in percent of all CPUs' time. A busy or
    stolen host runs every stage of the hold slower."""
    def sample() -> list[int]:
        with open("/proc/stat") as f:
            return [int(v) for v in f.readline().split()[1:9]]

    try:
        a = sample()
        time.sleep(window_s)
        b = sample()
    except OSError:
        return "cpu shares: unknown"
    d = [y - x for x, y in zip(a, b, strict=True)]
    total = sum(d) or 1
    # user nice system idle iowait irq softirq steal
    busy = d[0] + d[1] + d[2] + d[5] + d[6]
    return (f"cpu busy {100 * busy / total:.1f}%, stolen {100 * d[7] / total:.1f}% "
            f"over {window_s:g} s")


def _spread(values: list[float]) -> str:
    return f"{min(values):.1f} / {statistics.median(values):.1f} / {max(values):.1f}"


def main() -> None:
    import argparse
    import subprocess

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--processes", type=int, default=5)
    ap.add_argument("--one", action="store_true", help=argparse.SUPPRESS)  # a child's part
    args = ap.parse_args()
    if args.one:
        print(_median_ms(python_work), _median_ms(protobuf_work), wake_us(500))
        return
    print(cpu_shares())  # before the timings: the host as the run found it
    runs = [[float(v) for v in subprocess.run(
                [sys.executable, os.path.abspath(__file__), "--one"], check=True,
                capture_output=True, text=True).stdout.split()]
            for _ in range(max(1, args.processes))]
    py, pb, wake = ([r[i] for r in runs] for i in range(3))
    print(f"host speed: python work {_spread(py)} ms, protobuf work {_spread(pb)} ms, "
          f"socket wake-up {_spread(wake)} us (least / median / most of {len(runs)} "
          "processes, each the median of its rounds; lower is faster)")


if __name__ == "__main__":
    main()
