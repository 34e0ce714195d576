"""A drained worker (exit 0 after SIGTERM) is restarted at once and is no crash: its
backoff does not grow, unlike a worker that fails."""

from __future__ import annotations

import sys

from deploy.cluster import ClusterSpec, LocalCluster
from deploy.supervisor import BACKOFF_FIRST_S, Supervisor


def _cluster(worker_code: str) -> LocalCluster:
    c = LocalCluster(ClusterSpec(producers=0, consumers=0, colocated=1))
    c._spawn("router", [sys.executable, "-c", "import time; time.sleep(60)"])
    c._spawn("worker-0", [sys.executable, "-c", worker_code])
    return c


def test_drained_exit_restarts_at_once_without_backoff() -> None:
    c = _cluster("import sys; sys.exit(0)")
    said: list[str] = []
    clock = [1000.0]
    sup = Supervisor(c, say=said.append, clock=lambda: clock[0])
    try:
        first = c.procs["worker-0"]
        for i in range(3):
            c.procs["worker-0"].wait(30)
            sup.poll()  # the same poll restarts it: no waiting on the clock
            assert said[-1] == "worker-0 drained and exited 0; restarted"
            assert sup.restarts == i + 1
        assert c.procs["worker-0"] is not first
        assert sup.crashes == 0
        # now it fails: the first crash waits the first backoff, not a grown one
        c.cmds["worker-0"] = [sys.executable, "-c", "import sys; sys.exit(2)"]
        c.procs["worker-0"].wait(30)
        sup.poll()  # the drained incarnation (exit 0) restarts in the failing command
        c.procs["worker-0"].wait(30)
        sup.poll()
        assert said[-1].endswith(f"restarting in {BACKOFF_FIRST_S:.0f} s"), said
        assert sup.crashes == 1
    finally:
        c.stop()
