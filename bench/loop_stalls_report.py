"""Which process's event loop was stalled while the first-token hold's slowest requests
waited, and how: the stalls the serving processes recorded (deploy/loop_stalls.py, run with
PDSERVE_LOOP_STALLS=DIR) against the hold of each request in `pdserve bench` result files.

    python bench/loop_stalls_report.py STALLS_DIR RESULT.json [RESULT.json ...] [--timeline MS]

For each point of each result: per process, the stalls above 1/2/4 ms inside the point's
time span and how their late time splits (ran Python / waited for a CPU / neither: asleep,
the GIL, a lock); then each of the slowest 1% of holds (at least 3) with the stalls that
overlap it. A stall's late part is the last ``late_ms`` of its interval: the loop should
have woken at its start plus one tick. ``--timeline MS`` then lists every stall late by MS or
more, all processes in time order (ms from the first point's first hold), and the moments
when three or more processes waited for a CPU at once (the host's CPUs all taken). Last,
the hypervisor's steal time per CPU over the longest-recorded process's run, where its file
has it (a stall whose CPU shows none had no steal). Files may be gzipped (``.json.gz``), as
bench/results keeps them.
"""

from __future__ import annotations

import argparse
import gzip
import json
from pathlib import Path
from typing import Any


def load_stalls(stall_dir: Path) -> list[dict[str, Any]]:
    """One entry per process file, its stalls as (late_start_ns, late_end_ns, stall)."""
    procs = []
    for f in sorted([*stall_dir.glob("*.json"), *stall_dir.glob("*.json.gz")]):
        d = _read_json(f)
        tick_ns = int(d["tick_ms"] * 1e6)
        d["spans"] = [(s["start_ns"] + tick_ns, s["start_ns"] + int(s["wall_ms"] * 1e6), s)
                      for s in d["stalls"]]
        d["label"] = f"{d['name']}-{d['pid']}"
        procs.append(d)
    return procs


def _read_json(path: Path) -> Any:
    if path.suffix == ".gz":
        with gzip.open(path, "rt") as f:
            return json.load(f)
    return json.loads(path.read_text())


def split(stalls: list[dict[str, Any]]) -> str:
    """The late time of these stalls, and how much of their intervals the thread ran, queued
    for a CPU, or neither (as shares of their whole intervals)."""
    wall = sum(s["wall_ms"] for s in stalls)
    late = sum(s["late_ms"] for s in stalls)
    cpu = sum(s["cpu_ms"] for s in stalls)
    queued = sum(max(s["queued_ms"], 0.0) for s in stalls)
    gc = sum(s["gc_ms"] for s in stalls)
    if not wall:
        return "none"
    other = max(wall - cpu - queued, 0.0)
    return (f"late {late:.1f} ms; of their {wall:.1f} ms: ran {100 * cpu / wall:.0f}% "
            f"(gc {gc:.1f} ms), queued {100 * queued / wall:.0f}%, "
            f"neither {100 * other / wall:.0f}%")


def _rest(s: dict[str, Any]) -> str:
    """What the recorder adds for the time the loop thread neither ran nor queued (absent
    from the files of its first version)."""
    if "others_cpu_ms" not in s:
        return ""
    on = f", on CPU {s['cpu']}" if s.get("cpu", -1) >= 0 else ""
    return (f", other threads ran {s['others_cpu_ms']:.2f}, blocked {s['blocked']}x, "
            f"preempted {s['preempted']}x, major faults {s['major_faults']}{on}")


def steal_line(procs: list[dict[str, Any]]) -> str | None:
    """The steal time per CPU over the run of the process recorded longest (each file reads
    the host's /proc/stat at its start and end); None if no file carries it."""
    known = [p for p in procs if p.get("steal_known")]
    if not known:
        return None
    p = max(known, key=lambda p: p["ended_ns"] - p["started_ns"])
    steal = {int(c): v for c, v in p["steal_ms"].items()}
    secs = (p["ended_ns"] - p["started_ns"]) / 1e9
    if not steal:
        return f"steal over {secs:.0f} s ({p['label']}): none on any CPU"
    cpus = ", ".join(f"CPU {c} {v:.0f} ms" for c, v in sorted(steal.items()))
    return (f"steal over {secs:.0f} s ({p['label']}): {sum(steal.values()):.0f} ms in all "
            f"(/proc/stat, 10 ms units): {cpus}")


def overlapping(procs: list[dict[str, Any]], lo: int, hi: int) -> list[tuple[str, dict[str, Any]]]:
    return [(p["label"], s) for p in procs for a, b, s in p["spans"] if a < hi and b > lo]


def report_point(name: str, point: dict[str, Any], procs: list[dict[str, Any]]) -> list[str]:
    reqs = [r for r in point["requests"] if r.get("hold_ms") is not None
            and r.get("token0_sampled_ns")]
    if not reqs:
        return [f"{name} {point['label']}: no request carries token0_sampled_ns (a result "
                "from before it was recorded, or colocated)"]
    first = min(r["token0_sampled_ns"] for r in reqs)
    last = max(r["token0_sampled_ns"] + int(r["hold_ms"] * 1e6) for r in reqs)
    lines = [f"{name} {point['label']}: {len(reqs)} holds over {(last - first) / 1e9:.2f} s"]
    for p in procs:
        inside = [s for a, b, s in p["spans"] if a < last and b > first]
        counts = "/".join(str(sum(s["late_ms"] > t for s in inside)) for t in (1, 2, 4))
        worst = max((s["late_ms"] for s in inside), default=0.0)
        lines.append(f"  {p['label']:<24} stalls >1/2/4 ms {counts}, worst {worst:.1f} ms; "
                     f">2 ms: {split([s for s in inside if s['late_ms'] > 2])}")
    slow = sorted(reqs, key=lambda r: -r["hold_ms"])[:max(3, len(reqs) // 100)]
    for r in slow:
        lo = r["token0_sampled_ns"]
        hi = lo + int(r["hold_ms"] * 1e6)
        parts = ", ".join(f"{k[5:-3]} {r[k]:.2f}" for k in (
            "hold_engine_ms", "hold_producer_ms", "hold_writer_ms", "hold_wire_ms",
            "hold_router_ms") if r.get(k) is not None)
        lines.append(f"  request {r['index']}: hold {r['hold_ms']:.2f} ms ({parts})")
        for label, s in overlapping(procs, lo, hi):
            lines.append(f"    {label}: late {s['late_ms']:.2f} ms, ran {s['cpu_ms']:.2f}, "
                         f"queued {s['queued_ms']:.2f}, gc {s['gc_ms']:.2f}{_rest(s)} "
                         f"(starts {(s['start_ns'] - lo) / 1e6:+.2f} ms from sampled)")
    return lines


def timeline(procs: list[dict[str, Any]], t0: int, min_ms: float,
             together_ms: float = 3.0) -> list[str]:
    """Every stall late by ``min_ms`` or more, in time order; then the moments when three or
    more processes' stalls, each mostly queued for a CPU, ended within ``together_ms``."""
    rows = sorted((b, p["label"], s) for p in procs for _, b, s in p["spans"]
                  if s["late_ms"] >= min_ms)
    lines = [f"stalls late >= {min_ms:g} ms, ms from the first hold (at the stall's end):"]
    lines += [f"  {(b - t0) / 1e6:10.1f} {label:<24} late {s['late_ms']:6.2f} ran "
              f"{s['cpu_ms']:6.2f} queued {s['queued_ms']:6.2f} gc {s['gc_ms']:6.2f}{_rest(s)}"
              for b, label, s in rows]
    queued = [(b, label) for b, label, s in rows if s["queued_ms"] > s["late_ms"] / 2]
    groups: list[list[tuple[int, str]]] = []
    for b, label in queued:
        if groups and b - groups[-1][-1][0] < together_ms * 1e6:
            groups[-1].append((b, label))
        else:
            groups.append([(b, label)])
    together = [g for g in groups if len({label for _, label in g}) >= 3]
    lines.append(f"host-wide: {len(together)} moments when 3 or more processes queued for a CPU "
                 f"at once: " + ", ".join(f"{(g[0][0] - t0) / 1e6:.0f} ms "
                                         f"({len({lb for _, lb in g})} processes)"
                                         for g in together))
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("stalls", type=Path, help="the PDSERVE_LOOP_STALLS directory")
    ap.add_argument("results", type=Path, nargs="+", help="pdserve bench result files")
    ap.add_argument("--timeline", type=float, metavar="MS", default=None,
                    help="also list every stall late by MS or more, all processes in time order")
    args = ap.parse_args(argv)
    procs = load_stalls(args.stalls)
    if not procs:
        print(f"{args.stalls}: no stall files (was PDSERVE_LOOP_STALLS set for the servers?)")
        return 1
    first: int | None = None
    for path in args.results:
        d = _read_json(path)
        for cfg in d["configs"]:
            for point in cfg["points"]:
                print("\n".join(report_point(path.name.split(".")[0], point, procs)))
                starts = [r["token0_sampled_ns"] for r in point["requests"]
                          if r.get("token0_sampled_ns")]
                if starts:
                    first = min(starts) if first is None else min(first, min(starts))
    if args.timeline is not None:
        t0 = first if first is not None else min(
            (a for p in procs for a, _, _ in p["spans"]), default=0)
        print("\n".join(timeline(procs, t0, args.timeline)))
    steal = steal_line(procs)
    if steal is not None:
        print(steal)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
