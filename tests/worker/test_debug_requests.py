"""Held blocks are explainable on a live worker: GET /debug/requests on a worker's metrics
port lists every request holding KV blocks (id, state, ages, blocks), and the blocks it
lists are exactly the pool's used blocks."""

from __future__ import annotations

import json
import time
import urllib.request
from typing import Any

import grpc
import pytest
from cluster_client import chat, stub_for, wait_for_full_kv
from live_cluster import dump_logs
from pdserve.v1 import common_pb2, router_pb2

from deploy.cluster import LocalCluster

LONG = "Disaggregated serving splits prefill from decode so each can scale on its own. " * 20


@pytest.fixture(scope="module")
def cluster(worker_1p1d: LocalCluster) -> LocalCluster:
    return worker_1p1d  # tests/worker/conftest.py: shared, nothing here changes it


def _held(port: int) -> dict[str, Any]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/debug/requests", timeout=10) as r:
        assert r.headers["Content-Type"].startswith("application/json")
        return json.loads(r.read())  # type: ignore[no-any-return]


def _wait(port: int, pred: Any, timeout: float = 60.0) -> dict[str, Any]:
    end = time.monotonic() + timeout
    while True:
        got = _held(port)
        if pred(got) or time.monotonic() > end:
            return got
        time.sleep(0.1)


def test_debug_requests_lists_what_holds_blocks(cluster: LocalCluster) -> None:
    ch, stub = stub_for(cluster.router_address)
    consumer = cluster.metrics_ports["worker-1"]
    producer = cluster.metrics_ports["worker-0"]
    assert _held(consumer)["requests"] == [] and _held(producer)["requests"] == []
    req = router_pb2.GenerateRequest(sampling=common_pb2.SamplingParams(
        max_tokens=1000, temperature=0, ignore_eos=True), **chat(LONG))
    call = stub.Generate(req, timeout=120)
    try:
        for n, _ in enumerate(call):
            if n == 3:  # tokens are streaming: the consumer is decoding it
                break
        got = _wait(consumer, lambda g: any(r["state"] == "DECODING" for r in g["requests"]))
        (row,) = got["requests"]
        assert row["state"] == "DECODING", (got, dump_logs(cluster))
        assert row["blocks"] > 0 and row["age_s"] > 0 and row["request_id"]
        assert 0 <= row["state_age_s"] <= row["age_s"]
        # every used block belongs to a listed request
        assert got["total"] == 1
        assert sum(r["blocks"] for r in got["requests"]) == \
            got["kv_blocks_total"] - got["kv_blocks_free"]
    finally:
        call.cancel()
    with pytest.raises(grpc.RpcError):
        for _ in call:
            pass
    wait_for_full_kv(stub)
    got = _wait(consumer, lambda g: g["requests"] == [])
    assert got["requests"] == [] and got["kv_blocks_free"] == got["kv_blocks_total"], got
    assert _held(producer)["requests"] == []
    ch.close()
