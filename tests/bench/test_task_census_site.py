"""bench/probes/task_census_site: a real router process started with the directory on its
path prints its loop's tasks by coroutine once a second, and still stops cleanly."""

from __future__ import annotations

import os
import re
from pathlib import Path

from bare_router import bare_router

SITE = Path(__file__).resolve().parents[2] / "bench" / "probes" / "task_census_site"


def test_a_router_counts_its_tasks_and_stops() -> None:
    env = {**os.environ, "PYTHONPATH": f"{SITE}:{os.environ.get('PYTHONPATH', '')}"}
    with bare_router(env) as (p, _):
        assert p.stdout is not None
        census = next((ln for ln in p.stdout if ln.startswith("TASKS ")), None)
        assert census is not None, "no census line before the router's output ended"
        m = re.match(r"TASKS (\d+) pid (\d+) \[(.*)\]$", census.strip())
        assert m and int(m[2]) == p.pid, census
        # an idle router: its own sweep and the census itself among the counted tasks
        assert int(m[1]) >= 2 and "census" in m[3] and "RouterServer._sweep" in m[3], census
