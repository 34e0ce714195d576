"""`pdserve router --frontends N` runs N router processes on the same ports over
one view of the workers (router/control/frontends.py). Clients on many connections land on every
frontend; every request is served; workers registered through whichever frontend serve
the requests of all (the mirror's view: tests/router/test_frontend_mirror.py)."""

from __future__ import annotations

import concurrent.futures
import os
import time
from collections.abc import Iterator

import grpc
import pytest
from live_cluster import dump_logs, start_cluster
from pdserve.v1 import common_pb2, router_pb2, router_pb2_grpc

from deploy.cluster import LocalCluster

pytestmark = pytest.mark.slow
FRONTENDS = 2


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    c = start_cluster(tmp_path_factory, "frontends", producers=1, consumers=1,
                      worker_args=("--simulate-step-ms", "5", "--kv-cache-mib", "64"),
                      router_args=("--frontends", str(FRONTENDS), "--heartbeat-timeout", "3"))
    yield c
    c.stop()


def router_kids(cluster: LocalCluster) -> list[int]:
    primary = cluster.procs["router"].pid
    return [int(p) for p in open(f"/proc/{primary}/task/{primary}/children").read().split()]


def router_pids(cluster: LocalCluster) -> list[int]:
    # a mirror that exited is a zombie until reaped: no cmdline, so not counted
    return [cluster.procs["router"].pid,
            *[k for k in router_kids(cluster)
              if b"deploy.cli" in open(f"/proc/{k}/cmdline", "rb").read()]]


def kid_states(cluster: LocalCluster) -> str:
    """The primary's children and their states (Z: a mirror that exited), for a failure."""
    out = []
    for k in router_kids(cluster):
        with open(f"/proc/{k}/stat") as f:
            out.append(f"{k}: {f.read().rsplit(')', 1)[1].split()[0]}")
    return ", ".join(out) or "none"


def cpu_s(pid: int) -> float:
    fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def one_request(address: str, i: int) -> tuple[int, list[int]]:
    # a channel of its own: a new connection, which the kernel gives to some frontend
    with grpc.insecure_channel(address, options=[("grpc.use_local_subchannel_pool", 1)]) as ch:
        stub = router_pb2_grpc.RouterStub(ch)
        ids: list[int] = []
        finish = 0
        for r in stub.Generate(router_pb2.GenerateRequest(
                prompt_token_ids=router_pb2.TokenIds(ids=list(range(100, 132))),
                sampling=common_pb2.SamplingParams(max_tokens=24, ignore_eos=True,
                                                   seed=i)), timeout=120):
            ids += r.token_ids
            finish = r.finish_reason or finish
        return finish, ids


def test_every_frontend_serves_and_all_see_the_workers(cluster: LocalCluster) -> None:
    pids = router_pids(cluster)
    # a string, not a tuple: pytest prints it whole (a tuple's repr is cut mid-log)
    assert len(pids) == FRONTENDS, (f"{pids}; the primary's children: {kid_states(cluster)}\n"
                                    + dump_logs(cluster))
    # every frontend knows both workers (a mirror's view comes from the primary)
    deadline = time.monotonic() + 30
    while True:
        views = []
        for _ in range(12):  # new connections land on either process
            with grpc.insecure_channel(cluster.router_address,
                                       options=[("grpc.use_local_subchannel_pool", 1)]) as ch:
                st = router_pb2_grpc.RouterStub(ch).ClusterStatus(
                    router_pb2.ClusterStatusRequest(), timeout=10)
            views.append(sorted(w.worker_id for w in st.workers))
        if all(v == ["worker-0", "worker-1"] for v in views):
            break
        assert time.monotonic() < deadline, views
        time.sleep(0.5)
    before = {p: cpu_s(p) for p in pids}
    with concurrent.futures.ThreadPoolExecutor(32) as pool:
        results = list(pool.map(lambda i: one_request(cluster.router_address, i), range(96)))
    for finish, ids in results:
        assert finish == common_pb2.FINISH_REASON_LENGTH and len(ids) == 24, (finish, ids)
    # the same seed gives the same tokens whichever frontend placed it
    assert one_request(cluster.router_address, 5) == results[5]
    used = {p: cpu_s(p) - before[p] for p in pids}
    assert all(u > 0.05 for u in used.values()), used  # every frontend did real work
    logs = dump_logs(cluster)
    assert "stopped heartbeating" not in logs and "no heartbeat" not in logs, logs[-3000:]
