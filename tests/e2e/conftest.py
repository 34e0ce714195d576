"""Live clusters for end-to-end tests: real processes, real gRPC, real UCX, SmolLM2."""

from __future__ import annotations

import pytest
from live_cluster import start_cluster

from deploy.cluster import LocalCluster

# The session's clusters that are up, by fixture name. Each stops after the last test of
# the run that uses it (pytest_runtest_teardown below), not at the session's end: an idle
# cluster still costs ~2-3% of a core (heartbeats, load reports), and the other folders'
# tests that run after these take many minutes.
_UP: dict[str, LocalCluster] = {}


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> None:
    if not _UP:
        return
    items = item.session.items
    later = items[items.index(item) + 1:]
    for name in [n for n in _UP if n in item.fixturenames]:
        if not any(name in i.fixturenames for i in later):
            _UP.pop(name).stop()


@pytest.fixture(scope="session")
def cluster_1p1d(tmp_path_factory):  # type: ignore[no-untyped-def]
    c = _UP["cluster_1p1d"] = start_cluster(tmp_path_factory, "c1p1d",
                                            router_args=("--heartbeat-timeout", "3"))
    yield c
    _UP.pop("cluster_1p1d", None)
    c.stop()


@pytest.fixture(scope="session")
def cluster_pdc(tmp_path_factory):  # type: ignore[no-untyped-def]
    """1P1D plus a colocated worker, with the HTTP door: the churn storm and the worker-gRPC
    validation tests share it."""
    c = _UP["cluster_pdc"] = start_cluster(
        tmp_path_factory, "cpdc", colocated=1, http_port=0,
        worker_args=("--max-num-batched-tokens", "128", "--kv-cache-mib", "96"),
        router_args=("--heartbeat-timeout", "5", "--max-running-requests", "8",
                     "--max-queued-requests", "64"))
    yield c
    _UP.pop("cluster_pdc", None)
    c.stop()
