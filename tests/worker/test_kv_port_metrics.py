"""A live consumer worker exports its KV port's counters: a stranger's junk frame on the
KV port shows up in its /metrics (and in its registration load), and it keeps serving."""

from __future__ import annotations

import os
import re
import time
import urllib.request

import pytest
import zmq
from live_cluster import dump_logs

from deploy.cluster import LocalCluster

MALFORMED = "pdserve_worker_kv_malformed_messages_total"
REJECTED = "pdserve_worker_kv_rejected_handshakes_total"


@pytest.fixture(scope="module")
def cluster(worker_1p1d: LocalCluster) -> LocalCluster:
    return worker_1p1d  # tests/worker/conftest.py: shared, nothing here changes it


def _kv_address(cluster: LocalCluster) -> str:
    """The consumer's KV port, from the ready line it logs (the router's status omits it)."""
    assert cluster.log_dir
    with open(os.path.join(cluster.log_dir, "worker-1.log")) as f:
        m = re.search(r"'kv_address': '([^']+)'", f.read())
    assert m is not None, dump_logs(cluster)
    return m.group(1)


def _metric(port: int, name: str) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        text = r.read().decode()
    m = re.search(rf"^{name}\{{[^}}]*\}} (\S+)$", text, re.M)
    assert m is not None, f"{name} missing from /metrics:\n{text}"
    return float(m.group(1))


def _wait_metric(port: int, name: str, want: float, timeout: float = 20.0) -> float:
    end = time.monotonic() + timeout
    while True:
        got = _metric(port, name)
        if got >= want or time.monotonic() > end:
            return got
        time.sleep(0.2)


def test_a_junk_frame_on_the_consumer_kv_port_is_counted_on_metrics(
        cluster: LocalCluster) -> None:
    kv_address = _kv_address(cluster)
    port = cluster.metrics_ports["worker-1"]
    assert _metric(port, MALFORMED) == 0
    assert _metric(port, REJECTED) == 0
    # the producer's metrics carry its sender's counters too
    assert _metric(cluster.metrics_ports["worker-0"], MALFORMED) == 0

    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(kv_address)
        sock.send(b"\xc1")  # never valid msgpack
        got = _wait_metric(port, MALFORMED, 1)
        assert got == 1, dump_logs(cluster)
    finally:
        sock.close()
        ctx.term()
    assert cluster.status().workers  # the router still sees its workers
    assert all(w.healthy for w in cluster.status().workers), dump_logs(cluster)


def test_a_live_consumer_counts_its_decode_steps_on_metrics(cluster: LocalCluster) -> None:
    """One request of 20 tokens: the producer samples token 0, the consumer's engine steps
    report the other 19, one row each (the batch is that one request)."""
    from cluster_client import generate, stub_for
    from pdserve.v1 import router_pb2

    port = cluster.metrics_ports["worker-1"]
    names = {k: f"pdserve_worker_engine_{k}_total" for k in
             ("steps", "step_rows", "step_tokens", "step_seconds", "step_gap_seconds")}
    before = {k: _metric(port, n) for k, n in names.items()}
    ch, stub = stub_for(cluster.router_address)
    with ch:
        res = generate(stub, {"max_tokens": 20, "temperature": 0, "ignore_eos": True},
                       prompt_token_ids=router_pb2.TokenIds(ids=list(range(100, 140))))
    assert len(res.token_ids) == 20, (res, dump_logs(cluster))
    _wait_metric(port, names["step_tokens"], before["step_tokens"] + 19)
    d = {k: _metric(port, n) - before[k] for k, n in names.items()}
    assert d["step_tokens"] == 19 and d["step_rows"] == 19, d
    assert 19 <= d["steps"] <= 22, d  # deferred output: a step or two report nothing
    assert d["step_seconds"] > 0 and d["step_gap_seconds"] > 0, d


def test_a_repeated_prompt_hits_the_producers_prefix_cache_on_metrics(
        cluster: LocalCluster) -> None:
    """A reported case: the same 80-token prompt twice; the second prefill finds its full
    blocks cached, the producer's /metrics counts the looked-up and hit tokens, and the
    second response's usage says how many were cached."""
    from cluster_client import generate, stub_for
    from pdserve.v1 import router_pb2

    port = cluster.metrics_ports["worker-0"]
    q, h = ("pdserve_worker_prefix_cache_queried_tokens_total",
            "pdserve_worker_prefix_cache_hit_tokens_total")
    ids = list(range(300, 380))
    ch, stub = stub_for(cluster.router_address)
    with ch:
        first = generate(stub, {"max_tokens": 2, "temperature": 0},
                         prompt_token_ids=router_pb2.TokenIds(ids=ids))
        time.sleep(1.2)  # the next load report (every 0.5 s) carries the first's counts
        before = (_metric(port, q), _metric(port, h))
        second = generate(stub, {"max_tokens": 2, "temperature": 0},
                          prompt_token_ids=router_pb2.TokenIds(ids=ids))
    assert first.token_ids == second.token_ids, (first, second)
    _wait_metric(port, q, before[0] + len(ids))
    hit = _metric(port, h) - before[1]
    # every full block but the one holding the last token (it is always computed)
    assert len(ids) - 16 - 1 <= hit < len(ids), (hit, dump_logs(cluster))
    # and the client is told (gRPC usage; HTTP's prompt_tokens_details comes from it)
    assert (first.usage.cached_tokens, second.usage.cached_tokens) == (0, hit), (first, second)
