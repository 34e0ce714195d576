"""Whole-suite guards: no test may leave a process behind, and the run must end.

CI once printed a finished summary and then hung for its whole 90-minute limit. Two things
can do that after the last test: a leftover process that still holds the run's output pipe
(a cluster process started without a log directory inherits it), or an interpreter exit
that blocks. So pytest becomes the subreaper of everything it starts (orphans of killed
workers come back to it), every descendant still alive when the session ends is named,
killed and fails the run, and an exit that hangs dumps every thread's stack and ends.
"""

from __future__ import annotations

import ctypes
import faulthandler
import os
import signal
import sys
import time

import pytest

from deploy.cpu_threads import passive_omp_waits
from deploy.procs import cmdline, processes

# The engines tests build in this process wait passively, as every pdserve command that runs
# an engine makes its own do (deploy/cpu_threads.py); before anything loads torch.
passive_omp_waits()

PR_SET_CHILD_SUBREAPER = 36
GRACE_S = 10.0  # a cluster's stop waits for its leaders; their children may trail a little
EXIT_WATCHDOG_S = 120.0


def _descendants(root: int) -> dict[int, str]:
    """Live (non-zombie) descendants of ``root``: pid -> command line."""
    table = processes()
    children: dict[int, list[int]] = {}
    for p in table:
        children.setdefault(p.ppid, []).append(p.pid)
    zombies = {p.pid for p in table if p.state == "Z"}
    found: dict[int, str] = {}
    todo = [root]
    while todo:
        for pid in children.get(todo.pop(), []):
            todo.append(pid)
            if pid not in zombies:
                found[pid] = cmdline(pid)
    return found


def _reap() -> None:
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def _stop_resource_tracker() -> None:
    """multiprocessing's resource tracker (started in this process by the router's
    tokenize pool, a spawn-context ProcessPoolExecutor, in the in-process router tests)
    lives as long as the process that started it, by design; it is stopped here like any
    other child, before the leftover check below."""
    from multiprocessing import resource_tracker

    resource_tracker._resource_tracker._stop()  # closes its pipe and waits for it


def _end_plane_probes() -> None:
    """The ucx plane probe child (transfer/plane_probe.py) lives as long as the process
    whose sender started it, by design: any test with an in-process UCX sender (transfer,
    producer, consumer tests) starts it. It is ended here, before the leftover check."""
    if "transfer.plane_probe" in sys.modules:
        sys.modules["transfer.plane_probe"].close_all()


@pytest.fixture(scope="session")
def colocated_llm():  # type: ignore[no-untyped-def]
    """The reference for live-cluster tests (chaos, deploy, e2e): one in-process colocated
    engine on the embedded SmolLM2. One for the whole session: a build is ~5 s on 2 cores,
    and each of those folders built its own."""
    from engine.llm import LLM

    return LLM(None, max_num_batched_tokens=128)


def pytest_configure(config: pytest.Config) -> None:
    if sys.platform == "linux":
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if sys.platform != "linux":
        return
    _stop_resource_tracker()
    _end_plane_probes()
    end = time.monotonic() + GRACE_S
    while (left := _descendants(os.getpid())) and time.monotonic() < end:
        _reap()
        time.sleep(0.2)
    if not left:
        return
    for pid in left:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    _reap()
    lines = "\n".join(f"  {pid}: {cmd[:200]}" for pid, cmd in sorted(left.items()))
    sys.stderr.write(f"\nprocesses left running after the tests (killed now):\n{lines}\n")
    session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_unconfigure(config: pytest.Config) -> None:
    # what remains is interpreter exit; if that blocks, say where, and end
    faulthandler.dump_traceback_later(EXIT_WATCHDOG_S, exit=True)
