"""/proc CPU accounting of the serving-plane bench: a process group's leader counts as the
worker's service, what it spawned as its engine, and CPU burnt between two snapshots is
attributed to the process that burnt it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from deploy.benchmark.proc_cpu import cpu_between, group_pids, proc_cpu_s, snapshot

# The leader (the "service") spawns a child (the "engine"); the child burns CPU on a signal
# file's appearance, the leader stays idle.
LEADER = """
import subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", sys.argv[1], sys.argv[2]])
print(child.pid, flush=True)
child.wait()
"""
CHILD = """
import os, sys, time
while not os.path.exists(sys.argv[1]):
    time.sleep(0.01)
end = time.process_time() + 0.3
while time.process_time() < end:
    pass
time.sleep(30)
"""


def test_cpu_is_attributed_to_the_process_that_burnt_it(tmp_path):
    go = tmp_path / "go"
    leader = subprocess.Popen([sys.executable, "-c", LEADER, CHILD, str(go)],
                              stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        assert leader.stdout is not None
        child = int(leader.stdout.readline())
        assert group_pids(leader.pid) == sorted([leader.pid, child])
        before = snapshot({"consumer-0": leader.pid})
        assert before.part == {leader.pid: "consumer-0/service", child: "consumer-0/engine"}
        go.touch()
        deadline = time.monotonic() + 20
        while (proc_cpu_s(child) or 0) - before.cpu[child] < 0.3 \
                and time.monotonic() < deadline:
            time.sleep(0.05)
        used = cpu_between(before, snapshot({"consumer-0": leader.pid}))
        assert used["consumer-0/engine"]["cpu_s"] >= 0.25, used
        assert used["consumer-0/service"]["cpu_s"] < 0.1, used
        assert used["consumer-0/engine"]["procs"][0]["pid"] == child
    finally:
        os.killpg(leader.pid, signal.SIGKILL)
        leader.wait(10)
