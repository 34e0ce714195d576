"""`pdserve bench` against a live 1P1D cluster (SmolLM2 on CPU): the result file accounts for
every request, percentiles are ordered, and failed requests are reported, not hidden."""

from __future__ import annotations

import asyncio
import json
import math
import os

import pytest
from live_cluster import dump_logs, start_cluster

from deploy.benchmark.backend import SamplingChoice
from deploy.benchmark.grpc_backend import GrpcBackend
from deploy.benchmark.load import LoadPoint, run_requests
from deploy.benchmark.metrics import PointContext, summarize
from deploy.benchmark.workload import RequestSpec
from deploy.cli import main

pytestmark = pytest.mark.slow
STATS = ("p50", "p90", "p99")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):  # type: ignore[no-untyped-def]
    c = start_cluster(tmp_path_factory, "bench1p1d", http_port=0)
    yield c
    c.stop()


def test_cli_sweep_json(cluster, tmp_path) -> None:  # type: ignore[no-untyped-def]
    out = tmp_path / "r.json"
    rc = main(["bench", "--router", cluster.router_address, "--num-prompts", "5",
               "--warmup", "1", "--input-len", "16:40", "--output-len", "6", "--ignore-eos",
               "--concurrency", "1,4", "--rate", "inf", "--goodput", "ttft:60000",
               "--result-json", str(out), "--plots-dir", str(tmp_path / "plots")])
    assert rc == 0, dump_logs(cluster)
    doc = json.loads(out.read_text())
    (cfg,) = doc["configs"]
    assert cfg["workers"] == 2
    assert [p["label"] for p in cfg["points"]] == ["c=1", "c=4", "rate=inf"]
    for pt in cfg["points"]:
        m, reqs = pt["metrics"], pt["requests"]
        assert m["requests"] == m["completed"] + m["failed"] == len(reqs) == 5
        assert sorted(r["index"] for r in reqs) == list(range(5))
        assert m["failed"] == 0 and m["errors"] == {}
        assert m["total_output_tokens"] == 5 * 6  # --ignore-eos: exact lengths
        assert m["good_requests"] == 5
        for key in ("ttft_ms", "ttst_ms", "tpot_ms", "itl_ms", "e2el_ms", "hold_ms",
                    "kv_transfer_ms", "prefill_ms", "kv_ready_ms", "first_step_wait_ms"):
            vals = [m[key][s] for s in STATS]
            assert None not in vals and vals == sorted(vals), (key, m[key])
        # the handoff's stamps, per P/D request: the consumer's first step follows its
        # admission (one process's clock)
        handed = [r for r in reqs if r["kv_transfer_ms"] is not None]
        assert handed and all(r["first_step_wait_ms"] is not None and r["kv_ready_ms"]
                              is not None and r["first_step_wait_ms"] >= 0 for r in handed)
        # and kv_ready_ms in its parts: after the notice left, each follows the one before,
        # and together they are the whole (notice_sent_ms may be negative: a late router)
        for r in handed:
            parts = [r[k] for k in ("notice_sent_ms", "notice_wire_ms", "kv_copy_ms",
                                    "kv_poll_ms")]
            assert None not in parts and min(parts[1:]) >= 0, r
            assert sum(parts) == pytest.approx(r["kv_ready_ms"], abs=1e-3), r
        assert m["itl_ms"]["count"] >= 5 * (6 - 2)  # tokens may share a message
        assert m["ttft_ms"]["p50"] <= m["ttst_ms"]["p50"] <= m["e2el_ms"]["p50"]
        assert m["output_throughput_per_worker"] == pytest.approx(m["output_throughput"] / 2)
    pngs = sorted(os.listdir(tmp_path / "plots"))
    assert len(pngs) == 2 and pngs[0].startswith("cdf_") and pngs[1] == "throughput.png"


def test_failed_requests_reported(cluster) -> None:  # type: ignore[no-untyped-def]
    specs = [RequestSpec(tuple(range(1000, 1020)), 4),
             RequestSpec((10**7,), 4),  # outside the vocabulary: INVALID_ARGUMENT
             RequestSpec(tuple(range(2000, 2010)), 1)]  # one token: no TPOT

    async def go():  # type: ignore[no-untyped-def]
        b = GrpcBackend(cluster.router_address)
        await b.open()
        try:
            return await run_requests(b, specs, LoadPoint(2, math.inf),
                                      SamplingChoice(ignore_eos=True, timeout_s=60), seed=0)
        finally:
            await b.close()

    records, dur = asyncio.run(go())
    m = summarize(records, PointContext(dur, workers=2))
    assert (m["requests"], m["completed"], m["failed"]) == (3, 2, 1)
    (err,) = m["errors"]
    assert err.startswith("INVALID_ARGUMENT") and not records[1].success
    assert m["tpot_ms"]["count"] == 1 and m["ttft_ms"]["count"] == 2
    assert records[2].output_tokens == 1 and records[2].tpot is None


def test_openai_http_backend(cluster, tmp_path) -> None:  # type: ignore[no-untyped-def]
    out = tmp_path / "http.json"
    rc = main(["bench", "--backend", "openai", "--base-url",
               f"http://127.0.0.1:{cluster.http_port}", "--router", cluster.router_address,
               "--num-prompts", "4", "--warmup", "0", "--input-len", "20", "--output-len", "5",
               "--ignore-eos", "--concurrency", "2", "--result-json", str(out)])
    assert rc == 0, dump_logs(cluster)
    (pt,) = json.loads(out.read_text())["configs"][0]["points"]
    m = pt["metrics"]
    assert (m["completed"], m["failed"], m["workers"]) == (4, 0, 2)
    assert m["total_output_tokens"] == 4 * 5  # from usage (stream_options.include_usage)
    assert m["total_input_tokens"] == 4 * 20
    assert m["ttft_ms"]["p50"] <= m["e2el_ms"]["p50"] and m["itl_ms"]["count"] > 0
    assert m["hold_ms"]["count"] == 0  # HTTP carries no server timing
