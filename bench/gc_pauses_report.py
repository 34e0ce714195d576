"""The serving processes' collections within each point of a bench/serving_path_gpu.sh run
(run with SERVE_PY="python3 bench/probes/gc_garbage_probe.py --min-ms 1"): per point and
process log, how many collections of each generation ran while its requests were in flight,
their total and their longest, beside the point's first gap p50 and p99 (bench/itl_split.py
splits the gaps further).

    python bench/gc_pauses_report.py OUT_DIR [OUT_DIR...]

A point's span is its first token 0 (sampled, on the producer) to its last request's end:
the stretch in which a pause can stretch a stream's gap. A collection before it (the bench
client's own at the point's start, when it freezes its heap) is not counted. The probe's
lines carry each collection's start in Unix seconds.
"""

from __future__ import annotations

import glob
import json
import os
import re
import sys
from typing import Any

LINE = re.compile(r"GCPAUSE gen (\d) ([\d.]+) ms collected \d+ pid \d+ at ([\d.]+)")


def pauses(log: str) -> list[tuple[int, float, float]]:
    """(generation, ms, start in Unix seconds) of each collection the probe printed."""
    out = []
    with open(log, errors="replace") as f:
        for line in f:
            m = LINE.search(line)
            if m:
                out.append((int(m[1]), float(m[2]), float(m[3])))
    return out


def span(requests: list[dict[str, Any]]) -> tuple[float, float] | None:
    """First token 0 to last end, in Unix seconds (None: no stamps in this record)."""
    rows = [r for r in requests if r.get("token0_sampled_ns")]
    if not rows:
        return None
    t0 = [r["token0_sampled_ns"] / 1e9 for r in rows]
    t1 = [r["token0_sampled_ns"] / 1e9 + (r["e2el_ms"] - r["ttft_ms"]) / 1e3 for r in rows]
    return min(t0), max(t1)


def first_gaps(requests: list[dict[str, Any]]) -> list[float]:
    return sorted(r["ttst_ms"] - r["ttft_ms"] for r in requests
                  if r.get("success") and r.get("ttst_ms") and r.get("ttft_ms"))


def pct(xs: list[float], q: float) -> float:
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


def report(run: str) -> list[str]:
    logs = {os.path.basename(p)[:-4]: pauses(p) for p in sorted(glob.glob(f"{run}/*.log"))}
    lines = [run]
    for res in sorted(glob.glob(f"{run}/pd_*.json")):
        with open(res) as f:
            point = json.load(f)["configs"][0]["points"][0]
        rows = point["requests"]
        s = span(rows)
        if s is None:
            continue
        gaps = first_gaps(rows)
        lines.append(f"  {os.path.basename(res)[:-5]} ({s[1] - s[0]:.1f} s): first gap p50 "
                     f"{pct(gaps, 0.5):.1f} p99 {pct(gaps, 0.99):.1f} ms")
        for name, ps in logs.items():
            inside = [(g, ms) for g, ms, t in ps if s[0] <= t <= s[1]]
            if not inside:
                continue
            parts = []
            for gen in (0, 1, 2):
                ms = [m for g, m in inside if g == gen]
                if ms:
                    parts.append(f"gen {gen}: {len(ms)}, {sum(ms):.1f} ms, longest {max(ms):.1f}")
            lines.append(f"    {name}: " + "; ".join(parts))
    return lines


def main() -> None:
    if len(sys.argv) < 2:
        sys.exit("usage: gc_pauses_report.py OUT_DIR [OUT_DIR...]")
    for run in sys.argv[1:]:
        print("\n".join(report(run.rstrip("/"))))


if __name__ == "__main__":
    main()
