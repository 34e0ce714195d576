"""bench/tp_transfer_bench.py: its per-request numbers from server timing, and a CPU run of
the whole script (a live cluster: TP2 producer, TP1 consumer, tiny model)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from pdserve.v1 import router_pb2

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
from bench.tp_transfer_bench import request_times, summarize  # noqa: E402

ROOT = os.path.join(os.path.dirname(__file__), "..", "..")
MS = 1_000_000


def test_request_times_measures_landing_from_token0_against_prefill() -> None:
    t = router_pb2.ServerTiming(producer_received_ns=1_000 * MS,
                                producer_token0_sampled_ns=1_080 * MS,
                                router_token0_sent_ns=1_081 * MS,
                                consumer_kv_ready_ns=1_086 * MS,
                                consumer_first_step_ns=1_087 * MS, kv_transfer_ms=70.5,
                                producer="worker-0", consumer="worker-1")
    r = request_times(t)
    assert r["prefill_ms"] == 80.0 and r["land_ms"] == 6.0 and r["land_ratio"] == 0.075
    assert r["kv_transfer_ms"] == 70.5 and r["kv_transfer_ratio"] == 0.8812
    assert r["hold_ms"] == 1.0
    assert r["first_decode_after_land_ms"] == 1.0
    # a request whose consumer never reported its KV: no ratio (not a zero one)
    r = request_times(router_pb2.ServerTiming(producer_received_ns=1_000 * MS,
                                              producer_token0_sampled_ns=1_080 * MS))
    assert r["land_ms"] is None and r["land_ratio"] is None and r["kv_transfer_ms"] is None
    assert r["kv_transfer_ratio"] is None


def test_summarize_judges_the_median_and_skips_failures() -> None:
    recs = [{"prefill_ms": 100.0, "land_ms": x, "land_ratio": x / 100} for x in (5, 9, 30)]
    recs.append({"error": "DEADLINE_EXCEEDED: ..."})
    s = summarize(recs)
    assert s["requests"] == 4 and s["ok"] == 3
    assert s["land_ratio_p50"] == 0.09 and s["land_ratio_max"] == 0.3
    assert s["goal_met"] is True
    s = summarize(recs[1:])
    assert s["land_ratio_p50"] == pytest.approx(0.195) and s["goal_met"] is False
    assert summarize(recs[3:]) == {"requests": 1, "ok": 0}


@pytest.mark.slow
def test_tp_transfer_bench_on_cpu(tmp_path) -> None:  # type: ignore[no-untyped-def]
    out = tmp_path / "out"
    cmd = [sys.executable, os.path.join(ROOT, "bench", "tp_transfer_bench.py"), "--preset",
           "tiny", "--devices", "cpu,cpu", "--tokens", "128", "--chunk", "32",
           "--kv-cache-mib", "32", "--reps", "2", "--warmup", "1", "--threads", "1",
           "--backend", "ucx", "--out", str(out)]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=240, cwd=ROOT)
    assert p.returncode == 0, p.stdout + p.stderr
    doc = json.loads((out / "tp_transfer_ucx.json").read_text())
    ws = doc["workers"]
    assert (ws["worker-0"]["role"], ws["worker-1"]["role"]) == ("producer", "consumer")
    assert ws["worker-0"]["tp"] == 2 and ws["worker-1"]["tp"] == 1
    assert doc["summary"]["ok"] == 2 and len(doc["records"]) == 2
    for r in doc["records"]:
        assert r["producer"] == "worker-0" and r["consumer"] == "worker-1"
        assert r["prompt_tokens"] == 128 and r["output_tokens"] == 4
        # the KV lands after token 0 (the last push follows it), within the request
        assert 0 < r["prefill_ms"] < r["ttft_ms"] < r["e2e_ms"]
        assert 0 <= r["land_ms"] < r["e2e_ms"]
        assert r["land_ratio"] == pytest.approx(r["land_ms"] / r["prefill_ms"], rel=1e-3)
    assert (out / "logs_ucx" / "worker-0.log").exists()
