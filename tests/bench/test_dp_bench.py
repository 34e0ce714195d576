"""bench/dp_bench.py's CPU dry run: every layout serves its batches end to end (each
request still decoding through the timed steps) and the file holds every point."""

from __future__ import annotations

import json
import os
import subprocess
import sys

ROOT = os.path.join(os.path.dirname(__file__), "..", "..")


def test_dp_bench_dry_run_on_cpu(tmp_path):
    out = tmp_path / "dp.json"
    subprocess.run([sys.executable, "bench/dp_bench.py", "--device", "cpu", "--preset",
                    "tiny", "--batches", "1,3", "--context", "16", "--steps", "2",
                    "--out", str(out)], cwd=ROOT, check=True, timeout=600)
    res = json.loads(out.read_text())
    assert [r["layout"] for r in res["runs"]] == ["dpa_tp2", "tp2", "tp2_eager"]
    for r in res["runs"]:
        assert [p["per_rank"] for p in r["points"]] == [1, 3]
        assert [p["requests"] for p in r["points"]] == [2, 6]
        assert all(p["step_ms"] > 0 and p["tokens_per_s_per_gpu"] > 0 for p in r["points"])
        assert r["cuda_graphs"] is False
    dpa, tp2 = res["runs"][0], res["runs"][1]
    # the latent once per request (DPA) against on both ranks (TP2)
    assert dpa["kv_tokens_per_gpu"] * 2 == tp2["kv_tokens_per_gpu"]
    assert set(res["dpa_over_tp2"]) == {"1", "3"}
