"""bench/serving_cpu_bench.py at a tiny scale (simulated 1P1D, two client processes): its
JSON accounts for every requested token and attributes CPU to every cluster process."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PROMPTS, OUT_LEN = 16, 32


@pytest.mark.parametrize("backend", ["grpc", "http"])
def test_sim_run_counts_every_token_and_its_cpu(tmp_path, backend):
    out = tmp_path / "cpu.json"
    cmd = [sys.executable, os.path.join(ROOT, "bench", "serving_cpu_bench.py"),
           "--simulate-step-ms", "2", "--concurrency", "8", "--num-prompts", str(PROMPTS),
           "--input-len", "8:24", "--output-len", str(OUT_LEN), "--client-procs", "2",
           "--backend", backend, "--out", str(out), "--log-dir", str(tmp_path / "logs")]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    doc = json.loads(out.read_text())
    assert doc["failed"] == 0 and doc["completed"] == doc["requests"] == PROMPTS, doc["errors"]
    assert doc["tokens_expected"] == doc["tokens_counted"] == PROMPTS * OUT_LEN
    if backend == "grpc":  # SSE chunks carry no token count; usage gives tokens_counted
        assert doc["tokens_streamed"] == PROMPTS * OUT_LEN
    assert doc["messages"] >= PROMPTS and doc["tokens_per_s"] > 0
    assert doc["config"]["client_procs"] == 2
    cpu = doc["cpu"]
    assert doc["roles"] == {"worker-0": "producer", "worker-1": "consumer"}
    for part in ("router", "worker-0/service", "worker-0/engine", "worker-1/service",
                 "worker-1/engine", "clients"):
        assert cpu[part]["cpu_s"] > 0 and cpu[part]["us_per_token"] > 0, (part, cpu)
    # per-token CPU is the part's CPU over the tokens streamed
    r = cpu["router"]
    assert doc["tokens_basis"] == ("tokens_streamed" if backend == "grpc" else "tokens_counted")
    assert r["us_per_token"] == pytest.approx(r["cpu_s"] / doc[doc["tokens_basis"]] * 1e6,
                                              rel=0.01, abs=0.1)
    assert cpu["worker-1/service"]["procs"][0]["cmd"].find("consumer") >= 0
    for key in ("ttft_ms", "tpot_ms", "itl_ms"):
        d = doc[key]
        assert d["count"] > 0 and 0 < d["p50"] <= d["p90"] <= d["p99"], (key, d)
    # 2 ms steps: no token comes faster than a step on average
    assert doc["tpot_ms"]["p50"] >= 1.9
    assert "CPU µs/token" in run.stdout and "router" in run.stdout
