"""Keeps a launched cluster's workers running: a worker that exits is started again after a
backoff (1 s, doubling to 30 s; reset once it has run a minute), while the rest of the
cluster keeps serving. The router is not restarted: without it there is no cluster.

A worker that exits 0 was stopped on purpose (SIGTERM: it drained its requests first, as in
a rolling restart): it is started again at once, and it is no crash, so its backoff stays."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from deploy.cluster import LocalCluster

BACKOFF_FIRST_S = 1.0
BACKOFF_MAX_S = 30.0
STABLE_S = 60.0  # a worker up this long counts as healthy again: its backoff resets


@dataclass
class _Restarts:
    backoff_s: float = BACKOFF_FIRST_S
    due: float = 0.0  # monotonic time of the next start; 0: running
    started: float = 0.0


class RouterExited(RuntimeError):
    pass


class Supervisor:
    def __init__(self, cluster: LocalCluster, say: Callable[[str], None] = print,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.cluster = cluster
        self.say = say
        self.clock = clock
        now = clock()
        self._state = {n: _Restarts(started=now) for n in cluster.procs if n != "router"}
        self.restarts = 0  # every restart, drained ones included
        self.crashes = 0  # exits other than a drain (non-zero, or killed by a signal)

    def poll(self) -> None:
        """One look at every process: schedules and performs restarts. Raises RouterExited
        when the router is gone."""
        c = self.cluster
        if c.procs["router"].poll() is not None:
            raise RouterExited(c.exit_reason("router"))
        now = self.clock()
        for name, st in self._state.items():
            running = c.procs[name].poll() is None
            if running:
                if st.due == 0.0 and now - st.started >= STABLE_S:
                    st.backoff_s = BACKOFF_FIRST_S
                continue
            if st.due == 0.0 and c.procs[name].returncode == 0:
                c.respawn(name)
                st.started = now
                self.restarts += 1
                self.say(f"{name} drained and exited 0; restarted")
                continue
            if st.due == 0.0:
                self.crashes += 1
                st.due = now + st.backoff_s
                self.say(f"{c.exit_reason(name)}; restarting in {st.backoff_s:.0f} s")
                st.backoff_s = min(BACKOFF_MAX_S, st.backoff_s * 2)
            elif now >= st.due:
                c.respawn(name)
                st.due, st.started = 0.0, now
                self.restarts += 1
                self.say(f"{name} restarted")
