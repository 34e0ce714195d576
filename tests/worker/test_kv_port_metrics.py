"""A live consumer worker exports its KV port's counters: a stranger's junk frame on the
KV port shows up in its /metrics (and in its registration load), and it keeps serving."""

from __future__ import annotations

import os
import re
import time
import urllib.request
from collections.abc import Iterator

import pytest
import zmq
from live_cluster import dump_logs, start_cluster

from deploy.cluster import LocalCluster

MALFORMED = "pdserve_worker_kv_malformed_messages_total"
REJECTED = "pdserve_worker_kv_rejected_handshakes_total"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    c = start_cluster(tmp_path_factory, "kvmetrics")
    yield c
    c.stop()


def _kv_address(cluster: LocalCluster) -> str:
    """The consumer's KV port, from the ready line it logs (the router's status omits it)."""
    assert cluster.log_dir
    with open(os.path.join(cluster.log_dir, "consumer-0.log")) as f:
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
    port = cluster.metrics_ports["consumer-0"]
    assert _metric(port, MALFORMED) == 0
    assert _metric(port, REJECTED) == 0
    # the producer's metrics carry its sender's counters too
    assert _metric(cluster.metrics_ports["producer-0"], MALFORMED) == 0

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
