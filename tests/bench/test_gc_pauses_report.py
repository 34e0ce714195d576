"""bench/gc_pauses_report.py: a run's collections placed in the points whose requests were
in flight when they started."""

from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "bench"))

from gc_pauses_report import report  # noqa: E402

T0 = 1_800_000_000.0  # Unix seconds


def _row(sent: float, ttft_ms: float, e2el_ms: float, ttst_ms: float) -> dict:
    return {"success": True, "token0_sampled_ns": int((sent + ttft_ms / 1e3) * 1e9),
            "ttft_ms": ttft_ms, "ttst_ms": ttst_ms, "e2el_ms": e2el_ms}


def _point(path, rows: list[dict]) -> None:
    path.write_text(json.dumps({"configs": [{"points": [{"requests": rows}]}]}))


def test_collections_count_in_the_point_they_fell_in(tmp_path):
    # one point from its first token 0 at T0 + 0.1 s to T0 + 2 s, another from T0 + 10.1 s to
    # T0 + 11 s
    _point(tmp_path / "pd_a.json", [_row(T0, 100.0, 2000.0, 130.0),
                                     _row(T0 + 0.5, 100.0, 500.0, 150.0)])
    _point(tmp_path / "pd_b.json", [_row(T0 + 10, 100.0, 1000.0, 120.0)])
    (tmp_path / "router_pd.log").write_text("\n".join([
        "pdserve router: gRPC 127.0.0.1:50051",
        f"GCPAUSE gen 2 10.40 ms collected 0 pid 7 at {T0 + 0.05:.3f}",  # before any token 0
        f"GCPAUSE gen 1 4.00 ms collected 3 pid 7 at {T0 + 1.0:.3f}",
        f"GCPAUSE gen 1 6.00 ms collected 0 pid 7 at {T0 + 1.5:.3f}",
        f"GCPAUSE gen 2 25.50 ms collected 9 pid 7 at {T0 + 1.9:.3f}",
        f"GCPAUSE gen 2 40.00 ms collected 9 pid 7 at {T0 + 5.0:.3f}",  # between points
        f"GCPAUSE gen 0 1.20 ms collected 0 pid 7 at {T0 + 10.5:.3f}",
    ]) + "\n")
    (tmp_path / "producer.log").write_text("no collections here\n")
    lines = report(str(tmp_path))
    assert lines[1] == "  pd_a (1.9 s): first gap p50 50.0 p99 50.0 ms"
    assert lines[2] == ("    router_pd: gen 1: 2, 10.0 ms, longest 6.0; "
                        "gen 2: 1, 25.5 ms, longest 25.5")
    assert lines[3] == "  pd_b (0.9 s): first gap p50 20.0 p99 20.0 ms"
    assert lines[4] == "    router_pd: gen 0: 1, 1.2 ms, longest 1.2"
    assert len(lines) == 5  # the 10.4 ms one before pd_a's first token 0 and the 40 ms one between
    # the points are in neither; no producer line
