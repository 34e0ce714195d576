"""LocalCluster.wait_ready returns only once the router would place a request: a worker
that is healthy but whose event loop is still behind from start-up (as on a loaded 2-core
machine, where the engines' warm-up starves the gRPC processes) is refused as busy by the
router, so "ready" then would hand a test a cluster whose first request fails."""

from __future__ import annotations

import pytest
from pdserve.v1 import common_pb2, router_pb2

from deploy.cluster import ClusterSpec, LocalCluster


def _status(*lags: float, engine_age: float = 0.0) -> router_pb2.ClusterStatusResponse:
    return router_pb2.ClusterStatusResponse(workers=[
        router_pb2.WorkerStatus(worker_id=f"worker-{i}", healthy=True,
                                load=common_pb2.WorkerLoad(loop_lag_s=lag,
                                                           engine_report_age_s=engine_age))
        for i, lag in enumerate(lags)])


def _ready_after(spec: ClusterSpec, polls: list[router_pb2.ClusterStatusResponse],
                 monkeypatch: pytest.MonkeyPatch) -> int:
    """How many status polls wait_ready made before returning."""
    c = LocalCluster(spec)
    seen = iter(polls)
    calls = []

    def status(timeout: float = 2.0) -> router_pb2.ClusterStatusResponse:
        calls.append(1)
        return next(seen)
    monkeypatch.setattr(c, "status", status)
    monkeypatch.setattr("deploy.cluster.time.sleep", lambda s: None)
    c.wait_ready(2, timeout=60)
    return len(calls)


def test_waits_while_a_healthy_worker_is_behind(monkeypatch: pytest.MonkeyPatch) -> None:
    polls = [_status(3.1, 2.2), _status(0.4, 2.5), _status(0.1, 0.2)]
    assert _ready_after(ClusterSpec(), polls, monkeypatch) == 3


def test_follows_the_routers_busy_lag(monkeypatch: pytest.MonkeyPatch) -> None:
    polls = [_status(3.1, 2.2), _status(0.1, 0.2)]
    spec = ClusterSpec(router_args=("--heartbeat-timeout", "3", "--busy-lag", "5"))
    assert _ready_after(spec, polls, monkeypatch) == 1
    spec = ClusterSpec(router_args=("--busy-lag=1",))
    assert _ready_after(spec, [_status(1.5, 0), _status(0.9, 0)], monkeypatch) == 2
    # 0 turns the router's check off, so lag never holds start-up back
    assert _ready_after(ClusterSpec(router_args=("--busy-lag", "0")),
                        [_status(9.0, 9.0)], monkeypatch) == 1
    # the router's other test: an engine whose last load report is too old (10 s default)
    assert _ready_after(ClusterSpec(), [_status(0, 0, engine_age=12.0), _status(0, 0)],
                        monkeypatch) == 2
