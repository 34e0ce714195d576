"""A serving process's event-loop stalls, recorded for a diagnosis (``PDSERVE_LOOP_STALLS=DIR``).

Why: the first-token hold's tail on an H200 (issue 22: p99 <= 2 ms) is set by single events
of 3-5 ms in which a message the producer's gRPC process wrote reached the router late, all
the token 0s of one step at once (bench/RESULTS.md, session 52). Whether a loop was late
because it ran Python (its own work, or a collection), waited for a CPU (the host's
scheduler) or waited for the GIL (another thread of its process) decides the fix, and no
stamp on a message can tell which.

With the variable set, every process that serves on an event loop (``deploy/event_loop.py``:
the router and its frontends, the workers' gRPC processes) runs a 1 ms ticker on its loop. A
tick later than ``PDSERVE_LOOP_STALLS_MS`` (default 1) is a stall, and its interval is split
by the loop thread's CPU time, its wait on the run queue (``/proc/thread-self/schedstat``)
and the collector's pauses; what is left is time the thread was off the CPU without waiting
for one. For that rest, each stall also carries the CPU the process's other threads used
meanwhile (a thread holding the GIL), the loop thread's voluntary and involuntary context
switches (blocked on a futex, the GIL's among them, or in epoll; preempted) and its major
page faults (a read from disk). The process writes ``DIR/<command>-<pid>.json`` when its
loop ends; ``bench/loop_stalls_report.py`` lines the stalls up with the hold's slowest
requests. Off by default: the ticker is ~1,000 wake-ups a second, each a few syscalls.

Reading a stall whose time the loop thread neither ran nor queued: other threads' CPU about
as long, with two or more voluntary switches, is the GIL; one voluntary switch and nothing
else is a wake-up that came late (the loop slept in epoll past its data, e.g. a virtual
CPU the hypervisor did not run, whose time counts as neither); no switch at all is time
taken from a running thread below the kernel (steal); major faults are reads from disk.
Steal is also counted directly where the hypervisor reports it: each stall names the CPU
its loop thread was on when the tick came, and the file carries each CPU's steal time over
the whole run (``/proc/stat``, in 10 ms units: a CPU with none there had no stall of steal).
"""

from __future__ import annotations

import asyncio
import bisect
import json
import os
import resource
import sys
import time
from collections.abc import Coroutine
from dataclasses import asdict, dataclass
from typing import Any, TypeVar

from worker.heap import gc_pauses

ENV_DIR = "PDSERVE_LOOP_STALLS"
ENV_MS = "PDSERVE_LOOP_STALLS_MS"
TICK_NS = 1_000_000
KEEP = 400  # the longest stalls a file keeps (a run of minutes has a few hundred at most)
# lateness histogram: a tick's lateness in ms, counted below each edge (the last: above)
EDGES_MS = (0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0)
T = TypeVar("T")


@dataclass
class Stall:
    start_ns: int  # wall clock (time.time_ns, as the hold's stamps) of the tick before it
    wall_ms: float  # that tick -> this one (the 1 ms sleep included)
    late_ms: float  # wall_ms less the tick
    cpu_ms: float  # the loop thread ran (Python, the loop, a collection)
    queued_ms: float  # it was runnable and waited for a CPU (-1: no schedstat here)
    gc_ms: float  # collections in the process (any thread) within the interval
    others_cpu_ms: float  # CPU of the process's other threads within the interval
    blocked: int  # the loop thread's voluntary context switches (a futex, epoll, I/O)
    preempted: int  # its involuntary ones (the scheduler took the CPU away)
    major_faults: int  # its page faults that read from disk
    cpu: int = -1  # the CPU the loop thread was on when the late tick came (-1: unknown)


def process_name(argv: list[str]) -> str:
    """``router``, ``router-mirror`` (a frontend started by the primary), ``producer``, ..."""
    cmd = next((a for a in argv[1:] if not a.startswith("-")), "serve")
    return f"{cmd}-mirror" if "--primary" in argv else cmd


def steal_ms() -> dict[int, float]:
    """Each CPU's steal time so far (the hypervisor ran something else on it), in ms; empty
    where /proc/stat is not readable."""
    tick_ms = 1e3 / os.sysconf("SC_CLK_TCK")
    out: dict[int, float] = {}
    try:
        with open("/proc/stat") as f:
            for line in f:
                if not line.startswith("cpu") or line.startswith("cpu "):
                    continue
                name, *vals = line.split()
                if len(vals) >= 8:  # user nice system idle iowait irq softirq steal ...
                    out[int(name[3:])] = int(vals[7]) * tick_ms
    except (OSError, ValueError):
        return {}
    return out


def on_cpu() -> int:
    """The CPU the calling thread runs on (field 39 of /proc/thread-self/stat); -1 if
    unreadable."""
    try:
        with open("/proc/thread-self/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[36])
    except (OSError, IndexError, ValueError):
        return -1


class _RunQueueClock:
    """The calling thread's total wait on the run queue (ns), from schedstat's second field;
    None where the kernel keeps no schedstat."""

    def __init__(self) -> None:
        try:
            self._fd: int | None = os.open("/proc/thread-self/schedstat", os.O_RDONLY)
        except OSError:
            self._fd = None

    def read(self) -> int | None:
        if self._fd is None:
            return None
        try:
            return int(os.pread(self._fd, 128, 0).split()[1])
        except (OSError, IndexError, ValueError):
            return None

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


class StallRecorder:
    def __init__(self, name: str, threshold_ms: float = 1.0) -> None:
        self.name = name
        self.threshold_ns = int(threshold_ms * 1e6)
        self.ticks = 0
        self.hist = [0] * (len(EDGES_MS) + 1)
        self.stalls: list[Stall] = []
        self.started_ns = time.time_ns()
        self.steal_at_start = steal_ms()

    def note(self, stall: Stall) -> None:
        self.stalls.append(stall)
        if len(self.stalls) > 2 * KEEP:  # trim now and then, not at every stall
            self.stalls.sort(key=lambda s: -s.wall_ms)
            del self.stalls[KEEP:]

    def count(self, late_ms: float) -> None:
        self.ticks += 1
        self.hist[bisect.bisect_right(EDGES_MS, late_ms)] += 1

    async def run(self) -> None:
        """The ticker: runs on the loop it watches until cancelled (must start there: the
        CPU, run-queue and rusage clocks are the calling thread's)."""
        queue = _RunQueueClock()
        gc = gc_pauses()

        def usage() -> tuple[int, int | None, float, int, resource.struct_rusage]:
            return (time.thread_time_ns(), queue.read(), gc.total_s, time.process_time_ns(),
                    resource.getrusage(resource.RUSAGE_THREAD))

        try:
            wall, perf = time.time_ns(), time.perf_counter_ns()
            cpu, queued, gc_s, proc, ru = usage()
            while True:
                await asyncio.sleep(TICK_NS / 1e9)
                now_perf = time.perf_counter_ns()
                now = usage()
                elapsed = now_perf - perf
                late = elapsed - TICK_NS
                self.count(late / 1e6)
                if late > self.threshold_ns:
                    n_cpu, n_queued, n_gc, n_proc, n_ru = now
                    q = -1.0 if queued is None or n_queued is None else (n_queued - queued) / 1e6
                    mine = n_cpu - cpu
                    self.note(Stall(start_ns=wall, wall_ms=elapsed / 1e6, late_ms=late / 1e6,
                                    cpu_ms=mine / 1e6, queued_ms=q, gc_ms=(n_gc - gc_s) * 1e3,
                                    others_cpu_ms=max(n_proc - proc - mine, 0) / 1e6,
                                    blocked=n_ru.ru_nvcsw - ru.ru_nvcsw,
                                    preempted=n_ru.ru_nivcsw - ru.ru_nivcsw,
                                    major_faults=n_ru.ru_majflt - ru.ru_majflt,
                                    cpu=on_cpu()))
                wall, perf = time.time_ns(), time.perf_counter_ns()
                cpu, queued, gc_s, proc, ru = now
        finally:
            queue.close()

    def to_json(self) -> dict[str, Any]:
        longest = sorted(self.stalls, key=lambda s: -s.wall_ms)[:KEEP]
        now = steal_ms()
        steal = {c: round(now[c] - v, 3) for c, v in self.steal_at_start.items() if c in now}
        return {"name": self.name, "pid": os.getpid(), "tick_ms": TICK_NS / 1e6,
                "threshold_ms": self.threshold_ns / 1e6, "started_ns": self.started_ns,
                "ended_ns": time.time_ns(), "ticks": self.ticks,
                "steal_known": bool(steal),  # /proc/stat was read at both ends
                "steal_ms": {str(c): v for c, v in steal.items() if v > 0},
                "late_hist": {"edges_ms": list(EDGES_MS), "counts": self.hist},
                "stalls": [asdict(s) for s in sorted(longest, key=lambda s: s.start_ns)]}

    def dump(self, path: str) -> None:
        tmp = f"{path}.tmp"
        with open(tmp, "w") as f:
            json.dump(self.to_json(), f)
        os.replace(tmp, path)  # a reader never sees half a file


async def _recorded(main: Coroutine[Any, Any, T], out_dir: str, threshold_ms: float) -> T:
    rec = StallRecorder(process_name(sys.argv), threshold_ms)
    path = os.path.join(out_dir, f"{rec.name}-{os.getpid()}.json")
    loop = asyncio.get_running_loop()
    ticker = loop.create_task(rec.run())
    try:
        return await main
    finally:
        # at the end only: a dump every 5 s took the loop 2-4 ms each time on the H200
        # (session 52's first run of this), as long as the stalls it is there to find
        ticker.cancel()
        rec.dump(path)


def with_loop_stalls(main: Coroutine[Any, Any, T]) -> Coroutine[Any, Any, T]:
    """``main``, with the stall ticker beside it where PDSERVE_LOOP_STALLS names a directory;
    ``main`` itself otherwise. A bad threshold or a directory it cannot write ends the
    process at start, naming the variable (SystemExit: its message, no traceback)."""
    out_dir = os.environ.get(ENV_DIR, "")
    if not out_dir:
        return main
    raw = os.environ.get(ENV_MS, "1")
    try:
        threshold_ms = float(raw)
    except ValueError:
        main.close()
        raise SystemExit(f"pdserve: {ENV_MS}: {raw!r} is not a number of milliseconds") from None
    if not threshold_ms > 0:
        main.close()
        raise SystemExit(f"pdserve: {ENV_MS}: {raw!r} must be above 0")
    try:  # now, not when the loop ends: a directory it cannot write is said at start
        os.makedirs(out_dir, exist_ok=True)
        if not os.access(out_dir, os.W_OK):
            raise PermissionError(13, "not writable")
    except OSError as e:
        main.close()
        raise SystemExit(f"pdserve: {ENV_DIR}: cannot write to {out_dir!r} "
                         f"({e.strerror})") from None
    return _recorded(main, out_dir, threshold_ms)
