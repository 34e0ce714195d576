"""A worker's child process dies with it."""

from __future__ import annotations

import ctypes
import multiprocessing
import os
import signal
import sys


def die_with_parent() -> None:
    """A worker killed outright (SIGKILL, the OOM killer) must not leave its children
    behind: an engine holding the model, the KV pool and its ports, or a heartbeat process
    telling the router that a dead worker lives. Nothing else would ever stop them, since
    they only wait for the dead process. Call first thing in a spawned child."""
    parent = multiprocessing.parent_process()
    if sys.platform != "linux" or parent is None:
        return
    # the kernel signals when the *thread* that started us ends: WorkerServer.start runs on
    # the worker's main thread, which lives as long as the worker
    PR_SET_PDEATHSIG = 1  # noqa: N806 - the kernel's name
    # SIGKILL: the children ignore SIGTERM (a worker's drain is the parent's to run)
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent.pid:  # it died before the line above
        os._exit(1)
