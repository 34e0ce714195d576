"""A worker in another network namespace (another host, as far as sockets go) advertises its
abstract Unix socket like any worker; the router, in the root namespace, cannot reach that
name (abstract names belong to a namespace), reads the worker's Outputs over TCP instead,
says so once in its log, and serves the requests. Real processes: a router and a simulated
colocated worker under `ip netns exec`; skipped, with the reason, where namespaces cannot
be made."""

from __future__ import annotations

import netns_hosts
import pytest
from cluster_client import generate, stub_for
from live_cluster import dump_logs
from pdserve.v1 import router_pb2

from deploy.benchmark.dummy_model import write_dummy_model
from deploy.cluster import ClusterSpec, LocalCluster

pytestmark = pytest.mark.slow  # a live cluster
MAX_TOKENS = 8


def test_a_worker_in_another_namespace_is_read_over_tcp(tmp_path) -> None:  # type: ignore[no-untyped-def]
    model = write_dummy_model(str(tmp_path / "model"), "tiny")
    with netns_hosts.hub("pdou", "10.213.9.0", ["worker-0"]) as hub:
        spec = ClusterSpec(producers=0, consumers=0, colocated=1, model=model,
                           host=hub.hub_addr, worker_metrics=False,
                           worker_args=("--simulate-step-ms", "5", "--kv-cache-mib", "16"),
                           netns={"worker-0": (hub.ns["worker-0"], hub.addr["worker-0"])})
        c = LocalCluster(spec, log_dir=str(tmp_path / "logs"))
        c.start()
        try:
            ch, stub = stub_for(c.router_address)
            with ch:
                for i in range(3):
                    r = generate(stub, dict(max_tokens=MAX_TOKENS, seed=i),
                                 prompt_token_ids=router_pb2.TokenIds(ids=[100 + i, 7, 8]))
                    assert r.error == "" and len(r.token_ids) == MAX_TOKENS, dump_logs(c)
                (w,) = stub.ClusterStatus(router_pb2.ClusterStatusRequest()).workers
            assert w.outputs_unix.startswith("@pdserve-outputs-"), w
            assert w.outputs_address.startswith(hub.addr["worker-0"] + ":"), w
            assert w.outputs_transport == "tcp", (w, dump_logs(c))
            log = dump_logs(c)
            assert log.count("worker-0: reading its Outputs stream over tcp") == 1, log
            assert "another host or network namespace" in log
        finally:
            c.stop()
