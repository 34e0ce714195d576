"""Overload never passes for death, on a live 1P1D cluster.

A tiny model (its engine steps take milliseconds, so the consumer's service process carries
thousands of tokens a second, as a GPU worker's does) streams 128 requests through the
consumer while its gRPC (service) process is starved of CPU for 10 s: every thread of it is
pinned to one CPU at nice 10, against 8 busy-loop processes at nice 0 on that CPU, which
leaves it about 1.3% of the CPU (at nice 5, 4%, the service process now keeps up: it
sends one message per engine step). Competing processes rather than a cgroup CPU quota: they
need no root and no writable cgroup hierarchy, so the test runs the same on CI and on a
laptop. The event loop's token work falls behind (as a loop saturated by 256 streams does
on a GPU host); the engine process keeps decoding, and so does the worker's heartbeat
process (worker/heartbeat_process.py), which reads the loop's lag from the board the loop
writes. While the heartbeats left from a thread of the starved process, they needed that
process's GIL handed over several times a beat, each handover waiting for its threads to be
scheduled at ~1% of a CPU: 1-3 s a heartbeat, and on a slowed CI host the router dropped the
consumer (2026-12-05).

Then: the consumer is never dropped (the router hears from its heartbeats that it is
behind: busy); the requests streaming through it finish with all their tokens; new
requests are queued (placed before the router heard it was busy) or refused with
RESOURCE_EXHAUSTED naming the busy consumer; none fails mid-stream. When heartbeats ran on
the starved loop, the router dropped the consumer after 3 s and failed all its requests
(seen with this setup). A worker that is really stuck (SIGSTOPped past the timeout) is
still dropped and its requests migrate: tests/e2e/test_pd_migration.py.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from cluster_client import Result, generate, stub_for
from live_cluster import dump_logs, start_cluster
from pdserve.v1 import common_pb2, router_pb2
from steady_load import tiny_served_model

pytestmark = pytest.mark.slow

STARVE_S = 10.0
# the service process keeps ~110 / (8 * 1024 + 110) of its CPU; PDSERVE_STARVE_NICE=16 starves
# it harder (~36 / (8 * 1024 + 36)), as bench/RESULTS.md's heartbeat section records
HOGS, NICE = 8, int(os.environ.get("PDSERVE_STARVE_NICE", "10"))
# --busy-lag under what this starvation does to the loop (1-2 s behind, against the 3 s
# heartbeat timeout its heartbeats then missed), so the router's refusals are tested too
TIMEOUT_S, BUSY_LAG_S = 3.0, 1.0
STREAMS, STREAM_TOKENS = 128, 300  # still streaming when the starvation ends
HOG = ("import os, sys, time\n"
       "os.sched_setaffinity(0, {int(sys.argv[1])})\n"
       "end = time.monotonic() + float(sys.argv[2])\n"
       "while time.monotonic() < end:\n"
       "    pass\n")


def _prompt(i: int) -> dict[str, router_pb2.TokenIds]:
    return {"prompt_token_ids": router_pb2.TokenIds(ids=[5 + i % 200, 7, 9, 11, 13])}


class Starved:
    """Every thread of ``pid`` pinned to ``cpu`` at nice ``NICE``, against ``HOGS`` busy
    loops at nice 0 there."""

    def __init__(self, pid: int, cpu: int, seconds: float) -> None:
        self.pid, self.cpu, self.seconds = pid, cpu, seconds
        self.hogs: list[subprocess.Popen[bytes]] = []
        self.cpus = os.sched_getaffinity(pid)

    def _threads(self) -> list[int]:
        return [int(t) for t in os.listdir(f"/proc/{self.pid}/task")]

    def __enter__(self) -> Starved:
        # Each hog in its own session: with autogroup scheduling (most desktop and CI
        # kernels) a session's processes share one CPU share, so hogs in one session would
        # weigh as much as one. For the same reason the victim's nice is set on its
        # session's group too (it ranks the group against the hogs'); without autogroup the
        # threads' nice does that, for about the same share.
        self.hogs = [subprocess.Popen([sys.executable, "-c", HOG, str(self.cpu),
                                       str(self.seconds + 5)], start_new_session=True)
                     for _ in range(HOGS)]
        for tid in self._threads():  # threads it starts later inherit both
            os.sched_setaffinity(tid, {self.cpu})
            os.setpriority(os.PRIO_PROCESS, tid, NICE)
        self._group_nice(NICE)
        return self

    def _group_nice(self, nice: int) -> None:
        path = f"/proc/{self.pid}/autogroup"
        try:
            with open(path, "w") as f:
                f.write(str(nice))
        except OSError:  # no autogroup; or back to 0, which needs CAP_SYS_NICE
            pass

    def __exit__(self, *exc: object) -> None:
        for h in self.hogs:
            h.kill()
            h.wait()
        self._group_nice(0)
        for tid in self._threads():
            try:
                os.sched_setaffinity(tid, self.cpus)
                os.setpriority(os.PRIO_PROCESS, tid, 0)
            except (PermissionError, ProcessLookupError):  # as above; a thread that ended
                pass


class Watch:
    """Polls ClusterStatus from a thread: was worker-1 ever missing, how busy it looked."""

    def __init__(self, stub) -> None:  # type: ignore[no-untyped-def]
        self.stub = stub
        self.missing: list[float] = []
        self.max_lag = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(0.2):
            st = self.stub.ClusterStatus(router_pb2.ClusterStatusRequest(), timeout=10)
            c = next((w for w in st.workers if w.worker_id == "worker-1"), None)
            if c is None:
                self.missing.append(time.monotonic())
            else:
                self.max_lag = max(self.max_lag, c.load.loop_lag_s)

    def __enter__(self) -> Watch:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(15)


def _wait_decoding(stub, n: int, timeout: float = 120.0) -> None:  # type: ignore[no-untyped-def]
    end = time.monotonic() + timeout
    while True:
        st = stub.ClusterStatus(router_pb2.ClusterStatusRequest(include_requests=True))
        if sum(r.state == "DECODING" and r.tokens_streamed >= 2 for r in st.requests) >= n:
            return
        assert time.monotonic() < end, list(st.requests)
        time.sleep(0.05)


def _generate_retrying(stub, sampling, **inp) -> Result:  # type: ignore[no-untyped-def]
    """As a client does with a 429: try again after the hint. (The burst of streams can
    itself put the consumer's loop behind.)"""
    end = time.monotonic() + 120
    while True:
        r = generate(stub, sampling, 240, **inp)
        if r.code != grpc.StatusCode.RESOURCE_EXHAUSTED or time.monotonic() > end:
            return r
        time.sleep(1.0)


def test_a_cpu_starved_consumer_is_busy_never_dropped(tmp_path_factory):  # type: ignore[no-untyped-def]
    model = tiny_served_model(str(tmp_path_factory.mktemp("tiny")))
    c = start_cluster(tmp_path_factory, "overload", model=model,
                      worker_args=("--max-num-batched-tokens", "128", "--kv-cache-mib", "64"),
                      router_args=("--heartbeat-timeout", str(TIMEOUT_S),
                                   "--busy-lag", str(BUSY_LAG_S)))
    ch, stub = stub_for(c.router_address)
    cpu = max(os.sched_getaffinity(0))
    stream = dict(max_tokens=STREAM_TOKENS, temperature=0, ignore_eos=True)
    small = dict(max_tokens=8, temperature=0, ignore_eos=True)
    try:
        assert generate(stub, small, **_prompt(0)).error == ""
        with ThreadPoolExecutor(STREAMS + 32) as pool, Watch(stub) as watch:
            streams = [pool.submit(_generate_retrying, stub, stream, **_prompt(i))
                       for i in range(STREAMS)]
            _wait_decoding(stub, STREAMS // 2)
            fresh = []
            with Starved(c.procs["worker-1"].pid, cpu, STARVE_S):
                end = time.monotonic() + STARVE_S
                while time.monotonic() < end:  # new requests all along the starvation
                    fresh.append(pool.submit(generate, stub, small, 240,
                                             **_prompt(len(fresh))))
                    time.sleep(0.5)
            done = [f.result() for f in streams]
            new: list[Result] = [f.result() for f in fresh]
        logs = dump_logs(c)
        with open(c.log_paths["router"], errors="replace") as f:
            router_log = f.read()
        # what the router said about the consumer, without the per-request Abort lines that
        # fill the logs' tails when it was dropped (the drop's reason is then cut off)
        said = "\n".join(line for line in router_log.splitlines()
                         if "worker-1" in line and "Abort(" not in line)[-3000:]
        # never dropped, not even for a moment
        assert watch.missing == [], said + "\n" + logs
        assert "stopped heartbeating" not in router_log, said + "\n" + logs
        assert router_log.count("registered consumer worker-1") == 1, said + "\n" + logs
        # what makes this test mean something: its loop fell behind, and the router knew
        assert watch.max_lag > BUSY_LAG_S, (watch.max_lag, logs)
        assert "consumer worker-1 is busy: its event loop is" in router_log, logs
        # the requests streaming through it finished, every token
        for r in done:
            assert r.code is None and r.error == "", (r.code, r.details, r.error, logs)
            assert r.finish_reason == common_pb2.FINISH_REASON_LENGTH
            assert len(r.token_ids) == STREAM_TOKENS
        # new ones: queued (finished) or refused at once with a clear error, never failed.
        # Which of the two depends on when the router heard the consumer was busy (the
        # refusal itself: tests/router/test_liveness.py)
        for r in new:
            if r.code is None:
                assert r.error == "" and len(r.token_ids) == 8, (r.error, logs)
            else:
                assert r.code == grpc.StatusCode.RESOURCE_EXHAUSTED, (r.code, r.details)
                assert r.details.startswith("all 1 consumer is busy: worker-1: its event "
                                            "loop is"), r.details
                assert r.messages == 0  # refused before the first message
        # and once it caught up, it takes new requests again
        deadline = time.monotonic() + 30
        while (r := generate(stub, small, **_prompt(1))).code is not None:
            assert time.monotonic() < deadline, (r.code, r.details)
            time.sleep(0.5)
        assert r.error == "" and r.timing.consumer == "worker-1"
    finally:
        ch.close()
        c.stop()
