"""The launcher's restart policy against real (short-lived) processes and a test clock:
backoff doubles up to its cap, resets once a worker stays up, and a dead router ends it."""

from __future__ import annotations

import sys

import pytest

from deploy.cluster import ClusterSpec, LocalCluster
from deploy.supervisor import BACKOFF_MAX_S, STABLE_S, RouterExited, Supervisor


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def _cluster(worker_code: str) -> LocalCluster:
    c = LocalCluster(ClusterSpec(producers=0, consumers=0, colocated=1))
    c._spawn("router", [sys.executable, "-c", "import time; time.sleep(60)"])
    c._spawn("worker-0", [sys.executable, "-c", worker_code])
    return c


def _wait_exit(c: LocalCluster, name: str) -> None:
    c.procs[name].wait(30)


def test_backoff_doubles_to_its_cap_and_each_restart_runs_the_same_command() -> None:
    c = _cluster("import sys; print('engine process exited'); sys.exit(3)")
    clock, said = Clock(), []
    sup = Supervisor(c, say=said.append, clock=clock)
    try:
        delays = []
        for _ in range(7):
            _wait_exit(c, "worker-0")
            sup.poll()  # notices the exit, schedules the restart
            delays.append(float(said[-1].rsplit("restarting in ", 1)[1].split()[0]))
            sup.poll()
            assert said[-1].startswith("worker-0 exited")  # not yet due
            clock.t += delays[-1]
            sup.poll()
            assert said[-1] == "worker-0 restarted"
        assert delays == [1, 2, 4, 8, 16, 30, 30] and BACKOFF_MAX_S == 30
        assert said[0] == "worker-0 exited (exit 3): engine process exited; restarting in 1 s"
        assert sup.restarts == 7
    finally:
        c.stop()


def test_backoff_resets_after_a_stable_run() -> None:
    c = _cluster("import sys; sys.exit(1)")
    clock, said = Clock(), []
    sup = Supervisor(c, say=said.append, clock=clock)
    try:
        for _ in range(3):
            _wait_exit(c, "worker-0")
            sup.poll()
            clock.t += 60
            sup.poll()
        assert "restarting in 4 s" in said[-2]
        # a long-running incarnation: up STABLE_S, then it dies; back to the first delay
        c.cmds["worker-0"] = [sys.executable, "-c", "import time; time.sleep(60)"]
        _wait_exit(c, "worker-0")
        sup.poll()
        clock.t += 60
        sup.poll()
        clock.t += STABLE_S
        sup.poll()
        c.procs["worker-0"].kill()
        _wait_exit(c, "worker-0")
        sup.poll()
        assert said[-1] == "worker-0 exited (killed by signal 9); restarting in 1 s"
    finally:
        c.stop()


def test_a_dead_router_ends_supervision() -> None:
    c = _cluster("import time; time.sleep(60)")
    sup = Supervisor(c, say=lambda m: None, clock=Clock())
    try:
        c.procs["router"].kill()
        c.procs["router"].wait(10)
        with pytest.raises(RouterExited, match=r"router exited \(killed by signal 9\)"):
            sup.poll()
    finally:
        c.stop()
