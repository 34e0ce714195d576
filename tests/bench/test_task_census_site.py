"""bench/probes/task_census_site: a real router process started with the directory on its
path prints its loop's tasks by coroutine once a second, and still stops cleanly."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from deploy.ports import free_port

SITE = Path(__file__).resolve().parents[2] / "bench" / "probes" / "task_census_site"


def test_a_router_counts_its_tasks_and_stops() -> None:
    env = {**os.environ, "PYTHONPATH": f"{SITE}:{os.environ.get('PYTHONPATH', '')}"}
    p = subprocess.Popen([sys.executable, "-m", "deploy.cli", "router", "--host", "127.0.0.1",
                          "--grpc-port", str(free_port("127.0.0.1"))], env=env,
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        assert p.stdout is not None
        census = None
        for line in p.stdout:
            if line.startswith("TASKS "):
                census = line
                break
        if census is None:
            pytest.fail(f"no census line: {p.wait(10)}")
        m = re.match(r"TASKS (\d+) pid (\d+) \[(.*)\]$", census.strip())
        assert m and int(m[2]) == p.pid, census
        # an idle router: its own sweep and the census itself among the counted tasks
        assert int(m[1]) >= 2 and "census" in m[3] and "RouterServer._sweep" in m[3], census
        p.send_signal(signal.SIGTERM)
        assert p.wait(30) == 0
    finally:
        if p.poll() is None:
            p.kill()
            p.wait(10)
