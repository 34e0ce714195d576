"""The event-loop stall recorder (deploy/loop_stalls.py): a late tick is split into the loop
thread's CPU, its wait for a CPU and the rest, so a loop that ran Python is told from one
that slept or waited for another thread; off unless PDSERVE_LOOP_STALLS is set; a bad
threshold names its variable; a real router process writes its file when it stops."""

from __future__ import annotations

import asyncio
import json
import os
import sys
import threading
import time
from pathlib import Path

import pytest
from bare_router import bare_router

from deploy.event_loop import run_on
from deploy.loop_stalls import (
    ENV_DIR,
    ENV_MS,
    StallRecorder,
    on_cpu,
    process_name,
    steal_ms,
    with_loop_stalls,
)


async def _record(block: object, threshold_ms: float = 5.0) -> StallRecorder:
    rec = StallRecorder("test", threshold_ms)
    task = asyncio.get_running_loop().create_task(rec.run())
    await asyncio.sleep(0.05)  # some plain ticks first
    asyncio.get_running_loop().call_soon(block)  # type: ignore[arg-type]
    await asyncio.sleep(0.1)
    task.cancel()
    return rec


def _spin(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def _one_long(rec: StallRecorder, at_least_ms: float) -> dict[str, float]:
    longest = max(rec.stalls, key=lambda s: s.wall_ms)
    assert longest.wall_ms >= at_least_ms, rec.stalls
    return {"wall": longest.wall_ms, "cpu": longest.cpu_ms, "queued": longest.queued_ms}


def test_a_loop_that_ran_python_shows_cpu() -> None:
    rec = asyncio.run(_record(lambda: _spin(0.04)))
    s = _one_long(rec, 40)
    # the loop thread ran the whole stall (a busy 2-core runner may take a few ms of it)
    assert s["cpu"] >= 0.6 * s["wall"], s


def test_a_loop_that_slept_shows_neither_cpu_nor_queue() -> None:
    rec = asyncio.run(_record(lambda: time.sleep(0.04)))
    s = _one_long(rec, 40)
    assert s["cpu"] < 0.3 * s["wall"], s
    if s["queued"] >= 0:  # schedstat present: it was not waiting for a CPU either
        assert s["queued"] < 0.3 * s["wall"], s
    longest = max(rec.stalls, key=lambda x: x.wall_ms)
    # it blocked (the sleep), and no other thread of the process ran in its place
    assert longest.blocked >= 1 and longest.others_cpu_ms < 0.3 * longest.wall_ms, longest


def test_a_loop_waiting_for_the_gil_is_off_cpu() -> None:
    # another thread of the process holds the GIL in one long C call: the loop's tick is
    # late, and the loop thread neither ran nor queued for a CPU in that time
    def hog() -> None:
        time.sleep(0.02)
        sum(range(30_000_000))  # in C, under the GIL, without releasing it for long

    async def main() -> StallRecorder:
        rec = StallRecorder("test", 5.0)
        task = asyncio.get_running_loop().create_task(rec.run())
        t = threading.Thread(target=hog)
        t.start()
        while t.is_alive():
            await asyncio.sleep(0.001)
        # the ticker's late wake-up and this loop's may be ready together: let it run first
        await asyncio.sleep(0.01)
        task.cancel()
        return rec

    rec = asyncio.run(main())
    assert rec.stalls, "no stall while another thread held the GIL"
    total_wall = sum(s.wall_ms for s in rec.stalls)
    total_cpu = sum(s.cpu_ms for s in rec.stalls)
    assert total_cpu < 0.5 * total_wall, rec.stalls
    # ... while the other thread ran: its CPU is what the loop's stall was
    assert sum(s.others_cpu_ms for s in rec.stalls) > 0.5 * total_wall, rec.stalls


def test_ticks_are_counted_by_lateness() -> None:
    rec = asyncio.run(_record(lambda: _spin(0.02)))
    assert rec.ticks >= 50 and sum(rec.hist) == rec.ticks
    assert sum(rec.hist[5:]) >= 1  # the 20 ms tick: at or above the 4 ms edge (EDGES_MS[4])


def test_off_unless_the_variable_is_set(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ENV_DIR, raising=False)

    async def main() -> int:
        return 7

    coro = main()
    assert with_loop_stalls(coro) is coro
    assert asyncio.run(coro) == 7


def test_run_on_writes_the_file(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv(ENV_DIR, str(tmp_path / "stalls"))
    monkeypatch.setenv(ENV_MS, "2")

    async def main() -> str:
        await asyncio.sleep(0.05)
        _spin(0.03)
        await asyncio.sleep(0.02)
        return "done"

    assert run_on("asyncio", main()) == "done"
    (f,) = (tmp_path / "stalls").iterdir()
    assert f.name == f"{process_name(sys.argv)}-{os.getpid()}.json"
    d = json.loads(f.read_text())
    assert d["threshold_ms"] == 2.0 and d["ticks"] > 10
    assert any(s["wall_ms"] >= 30 and s["cpu_ms"] >= 15 for s in d["stalls"]), d["stalls"]
    # each stall names a CPU this process may run on; the run's steal is per CPU, in ms
    cpus = os.sched_getaffinity(0)
    assert all(s["cpu"] in cpus for s in d["stalls"]), d["stalls"]
    assert d["steal_known"] is True
    assert all(int(c) in steal_ms() and v > 0 for c, v in d["steal_ms"].items()), d


def test_the_cpu_is_the_one_the_thread_is_pinned_to() -> None:
    before = os.sched_getaffinity(0)
    try:
        for cpu in sorted(before)[:2]:
            os.sched_setaffinity(0, {cpu})
            assert on_cpu() == cpu
    finally:
        os.sched_setaffinity(0, before)


def test_steal_is_read_per_cpu_from_proc_stat() -> None:
    steal = steal_ms()
    assert set(steal) >= os.sched_getaffinity(0)  # every CPU this process may use
    tick_ms = 1e3 / os.sysconf("SC_CLK_TCK")
    for cpu, ms in steal.items():
        line = next(ln for ln in Path("/proc/stat").read_text().splitlines()
                    if ln.startswith(f"cpu{cpu} "))
        assert ms == int(line.split()[8]) * tick_ms


@pytest.mark.parametrize("raw", ["fast", "0", "-1"])
def test_a_bad_threshold_names_the_variable(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                            raw: str) -> None:
    monkeypatch.setenv(ENV_DIR, str(tmp_path))
    monkeypatch.setenv(ENV_MS, raw)

    async def main() -> None:
        return None

    with pytest.raises(SystemExit, match=f"{ENV_MS}: '{raw}'"):
        with_loop_stalls(main())


def test_a_directory_it_cannot_write_names_the_variable(monkeypatch: pytest.MonkeyPatch,
                                                       tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv(ENV_DIR, str(blocker / "stalls"))  # under a file: no directory there

    async def main() -> None:
        return None

    with pytest.raises(SystemExit, match=f"{ENV_DIR}: cannot write to"):
        with_loop_stalls(main())


def test_process_names() -> None:
    assert process_name(["-m", "router", "--grpc-port", "1"]) == "router"
    assert process_name(["x", "router", "--primary", "a:1"]) == "router-mirror"
    assert process_name(["x", "producer"]) == "producer"


def test_a_router_process_leaves_its_stalls(tmp_path: Path) -> None:
    out = tmp_path / "stalls"
    with bare_router({**os.environ, ENV_DIR: str(out)}) as (p, _):
        time.sleep(0.5)
    (f,) = out.iterdir()
    assert f.name == f"router-{p.pid}.json"
    d = json.loads(f.read_text())
    assert d["name"] == "router" and d["ticks"] > 100, d["ticks"]
