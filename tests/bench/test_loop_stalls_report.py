"""bench/loop_stalls_report.py: each slow hold is shown with the stalls that overlap it (and
only those), every process's stalls inside the point are counted and split, and a result
from before the sampled stamp is said to be one."""

from __future__ import annotations

import gzip
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "bench"))

from loop_stalls_report import main  # noqa: E402

MS = 1_000_000
T0 = 1_700_000_000_000 * MS


def _stall(start_ms: float, wall_ms: float, cpu_ms: float, queued_ms: float) -> dict:
    return {"start_ns": T0 + int(start_ms * MS), "wall_ms": wall_ms, "late_ms": wall_ms - 1,
            "cpu_ms": cpu_ms, "queued_ms": queued_ms, "gc_ms": 0.0}


def _write(tmp: Path, requests: list[dict]) -> tuple[Path, Path]:
    stalls = tmp / "stalls"
    stalls.mkdir()
    # the router's loop was late 4 ms around 100 ms (off the CPU, neither running nor
    # queued); the producer's late 2 ms at 500 ms, running Python
    (stalls / "router-11.json").write_text(json.dumps(
        {"name": "router", "pid": 11, "tick_ms": 1.0, "stalls": [_stall(99, 5, 0.5, 0.5)]}))
    (stalls / "producer-12.json").write_text(json.dumps(
        {"name": "producer", "pid": 12, "tick_ms": 1.0, "stalls": [_stall(499, 3, 2.8, 0)]}))
    result = tmp / "pd_hold.json"
    result.write_text(json.dumps({"configs": [{"points": [{"label": "c=16",
                                                           "requests": requests}]}]}))
    return stalls, result


def _req(i: int, at_ms: float, hold_ms: float) -> dict:
    return {"index": i, "hold_ms": hold_ms, "token0_sampled_ns": T0 + int(at_ms * MS),
            "hold_wire_ms": hold_ms - 1}


def test_slow_holds_meet_the_stalls_that_overlap_them(tmp_path: Path, capsys) -> None:
    reqs = [_req(i, 10 * i, 0.5) for i in range(60)]
    reqs[10] = _req(10, 98, 6.0)  # over the router's stall
    stalls, result = _write(tmp_path, reqs)
    assert main([str(stalls), str(result)]) == 0
    out = capsys.readouterr().out
    assert "pd_hold c=16: 60 holds" in out
    assert "router-11                stalls >1/2/4 ms 1/1/0, worst 4.0 ms" in out
    assert "ran 10% (gc 0.0 ms), queued 10%, neither 80%" in out
    block = out.split("request 10: hold 6.00 ms")[1].split("  request ")[0]
    assert "router-11: late 4.00 ms, ran 0.50, queued 0.50" in block
    assert "producer-12" not in block  # its stall was 400 ms later
    # the other listed requests (the slowest three in all) overlap no stall
    assert out.count("    router-11:") == 1


def test_a_result_without_the_stamp_says_so(tmp_path: Path, capsys) -> None:
    stalls, result = _write(tmp_path, [{"index": 0, "hold_ms": 1.0}])
    assert main([str(stalls), str(result)]) == 0
    assert "no request carries token0_sampled_ns" in capsys.readouterr().out


def test_no_stall_files_is_an_error(tmp_path: Path, capsys) -> None:
    (tmp_path / "empty").mkdir()
    _, result = _write(tmp_path, [])
    assert main([str(tmp_path / "empty"), str(result)]) == 1
    assert "no stall files" in capsys.readouterr().out


def test_the_off_cpu_rest_is_shown_where_recorded(tmp_path: Path, capsys) -> None:
    reqs = [_req(i, 10 * i, 0.5) for i in range(60)]
    reqs[10] = _req(10, 98, 6.0)
    stalls, result = _write(tmp_path, reqs)
    f = stalls / "router-11.json"
    d = json.loads(f.read_text())
    d["stalls"][0].update(others_cpu_ms=3.5, blocked=2, preempted=0, major_faults=0)
    f.write_text(json.dumps(d))
    assert main([str(stalls), str(result)]) == 0
    out = capsys.readouterr().out
    assert ("router-11: late 4.00 ms, ran 0.50, queued 0.50, gc 0.00, other threads ran "
            "3.50, blocked 2x, preempted 0x, major faults 0 (starts") in out
    assert "steal over" not in out  # files from before the steal was recorded


def test_the_cpu_and_the_runs_steal_are_shown_where_recorded(tmp_path: Path, capsys) -> None:
    reqs = [_req(i, 10 * i, 0.5) for i in range(60)]
    reqs[10] = _req(10, 98, 6.0)
    stalls, result = _write(tmp_path, reqs)
    for name, ended_s, steal in (("router-11", 30, {"3": 20.0, "5": 10.0}),
                                 ("producer-12", 10, {})):
        f = stalls / f"{name}.json"
        d = json.loads(f.read_text())
        d["stalls"][0].update(others_cpu_ms=0.1, blocked=1, preempted=0, major_faults=0,
                              cpu=5)
        d.update(started_ns=T0, ended_ns=T0 + ended_s * 1000 * MS, steal_known=True,
                 steal_ms=steal)
        f.write_text(json.dumps(d))
    assert main([str(stalls), str(result)]) == 0
    out = capsys.readouterr().out
    assert "blocked 1x, preempted 0x, major faults 0, on CPU 5 (starts" in out
    # the longest-recorded process's file speaks for the host
    assert out.rstrip().endswith("steal over 30 s (router-11): 30 ms in all (/proc/stat, "
                                 "10 ms units): CPU 3 20 ms, CPU 5 10 ms")


def test_the_timeline_finds_moments_every_process_queued(tmp_path: Path, capsys) -> None:
    # three processes each wait ~4 ms for a CPU ending at the same moment (a host-wide
    # burst); a fourth stall, running Python, is on the timeline but not such a moment;
    # files gzipped, as bench/results keeps them
    stalls = tmp_path / "stalls"
    stalls.mkdir()
    for pid, name, s in ((1, "router", _stall(199, 5, 0.1, 3.9)),
                         (2, "producer", _stall(199.5, 4.8, 0.1, 3.7)),
                         (3, "consumer", _stall(200, 4.5, 0.1, 3.4)),
                         (4, "router-mirror", _stall(700, 4, 3.0, 0))):
        with gzip.open(stalls / f"{name}-{pid}.json.gz", "wt") as f:
            json.dump({"name": name, "pid": pid, "tick_ms": 1.0, "stalls": [s]}, f)
    result = tmp_path / "pd_hold.json.gz"
    with gzip.open(result, "wt") as f:
        json.dump({"configs": [{"points": [{"label": "c=16", "requests":
                                            [_req(i, 10 * i, 0.5) for i in range(10)]}]}]}, f)
    assert main([str(stalls), str(result), "--timeline", "2"]) == 0
    out = capsys.readouterr().out
    assert "pd_hold c=16: 10 holds" in out
    rows = out.split("stalls late >= 2 ms")[1].splitlines()[1:-1]
    # every stall on the timeline, in time order (ms from the first hold, at each one's end)
    assert [r.split()[:2] for r in rows] == [["204.0", "router-1"], ["204.3", "producer-2"],
                                            ["204.5", "consumer-3"], ["704.0", "router-mirror-4"]]
    assert "host-wide: 1 moments when 3 or more processes queued for a CPU at once: " \
           "204 ms (3 processes)" in out
