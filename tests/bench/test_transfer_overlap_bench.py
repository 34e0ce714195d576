"""bench/transfer_overlap_bench.py on CPU with a tiny model: a real producer engine pushes
each chunk over UCX to a receiver process, and the landed bytes equal the producer's KV."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow
ROOT = os.path.join(os.path.dirname(__file__), "..", "..")
TOKENS, CHUNK = 64, 16


def test_overlap_bench_smoke(tmp_path) -> None:  # type: ignore[no-untyped-def]
    out = tmp_path / "overlap.json"
    cmd = [sys.executable, os.path.join(ROOT, "bench", "transfer_overlap_bench.py"), "--tiny",
           "--device", "cpu", "--backend", "ucx", "--tokens", str(TOKENS), "--chunk",
           str(CHUNK), "--reps", "1", "--out", str(out)]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert p.returncode == 0, p.stdout + p.stderr
    doc = json.loads(out.read_text())
    chunks = math.ceil(TOKENS / CHUNK)
    assert doc["chunks"] == chunks and doc["reps"] == 1 and len(doc["runs"]) == 1
    assert 0 < doc["prefill_alone_ms"] < 60_000
    (run,) = doc["runs"]
    assert 0 < run["prefill_ms"] < 60_000
    # the last bytes land after the first were pushed and no earlier than the FINISH they
    # wait for, which itself follows token 0
    assert math.isfinite(run["last_land_ms"]) and run["last_land_ms"] > 0
    assert run["prefill_ms"] <= run["finish_ms"] <= run["last_land_ms"] < 60_000
    assert doc["ratio"] == pytest.approx(run["last_land_ms"] / run["prefill_ms"])
    # one push per chunk: each chunk of 16 tokens fills exactly one 16-token block
    assert run["steps"] == chunks and run["pushes"] == chunks
    assert run["push_blocks"] == [1] * chunks and run["blocks"] == TOKENS // 16
    # the consumer's sha256 of its destination blocks equals the producer's source blocks,
    # and those hold computed KV (a zero pool on both sides would prove nothing)
    assert run["bytes_match"] and doc["all_bytes_match"] and run["src_nonzero"]
    assert doc["overshoot"] == pytest.approx(doc["ratio"] - 1)
