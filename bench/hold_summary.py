"""One line per run directory of bench/serving_path_gpu.sh (or serving_path_ab_gpu.sh): the
first-token hold (producer sampled -> router sent) p50 / p99 and its producer half at the
hold points, and the seeds' ITL p99 against TPOT p50 (issue 22's two H200 points); under
it, each point's hold in its parts, the slowest 1%'s included.

    python bench/hold_summary.py OUT_DIR
"""

from __future__ import annotations

import glob
import json
import os
import sys
from typing import Any

from itl_split import hold_line


def point(path: str) -> dict[str, Any] | None:
    try:
        with open(path) as f:
            return json.load(f)["configs"][0]["points"][0]  # type: ignore[no-any-return]
    except (OSError, KeyError, IndexError, ValueError):
        return None


def line(run: str) -> str:
    cells = [os.path.basename(run.rstrip("/"))]
    parts: list[str] = []
    for name in ("pd_hold", "pd_hold256", "pd_seeds"):
        p = point(os.path.join(run, name + ".json"))
        if p is None or "metrics" not in p:
            cells.append(f"{name}: missing")
            continue
        m = p["metrics"]
        cell = f"{name}: ok {m['completed']}/{m['requests']}"
        hold, half = m.get("hold_ms") or {}, m.get("hold_producer_ms") or {}
        if hold.get("p50") is not None:
            cell += (f" hold {hold['p50']:.2f}/{hold['p99']:.2f}"
                     f" producer half {half.get('p50', 0):.2f}/{half.get('p99', 0):.2f}")
        if name == "pd_seeds" and m.get("tpot_ms", {}).get("p50"):
            tpot, itl = m["tpot_ms"]["p50"], m["itl_ms"]["p99"]
            cell += f" TPOT {tpot:.2f} ITL p99 {itl:.1f} ({itl / tpot:.2f}x)"
        cells.append(cell)
        held = [r for r in p.get("requests", []) if r.get("hold_ms") is not None
                and r.get("hold_producer_ms") is not None]
        if held:  # where the hold's time goes, the tail's included (bench/itl_split.py)
            parts.append(f"  {name} hold: {hold_line(held)}")
    try:  # the host's speed (bench/probes/host_speed.py): holds scale with it
        with open(os.path.join(run, "host.txt")) as f:
            parts += [f"  {ln.strip()}" for ln in f if ln.startswith(("host speed", "cpu busy"))]
    except OSError:
        pass
    return "\n".join([" | ".join(cells), *parts])


def main() -> None:
    for run in sorted(glob.glob(os.path.join(sys.argv[1], "*/"))):
        print(line(run))


if __name__ == "__main__":
    main()
