"""Live clusters for end-to-end tests: real processes, real gRPC, real UCX, SmolLM2."""

from __future__ import annotations

import pytest
from live_cluster import start_cluster


@pytest.fixture(scope="session")
def cluster_1p1d(tmp_path_factory):  # type: ignore[no-untyped-def]
    c = start_cluster(tmp_path_factory, "c1p1d", router_args=("--heartbeat-timeout", "3"))
    yield c
    c.stop()


@pytest.fixture(scope="session")
def cluster_pdc(tmp_path_factory):  # type: ignore[no-untyped-def]
    """1P1D plus a colocated worker, with the HTTP door: the churn storm and the worker-gRPC
    validation tests share it."""
    c = start_cluster(tmp_path_factory, "cpdc", colocated=1, http_port=0,
                      worker_args=("--max-num-batched-tokens", "128", "--kv-cache-mib", "96"),
                      router_args=("--heartbeat-timeout", "5", "--max-running-requests", "8",
                                   "--max-queued-requests", "64"))
    yield c
    c.stop()
