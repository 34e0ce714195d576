"""A producer whose engine queue is full (``--max-waiting``) against a live 1P1D cluster
(tiny dummy model, real processes, a real gRPC client): a burst larger than the producer
can queue ends every request one of two ways, completed or refused up front with
RESOURCE_EXHAUSTED naming the full queue and a retry hint; none fails after it started
streaming, the producer stays registered, and the cluster serves the next request."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import grpc
import pytest
from live_cluster import dump_logs, start_cluster
from pdserve.v1 import common_pb2, router_pb2, router_pb2_grpc

from deploy.benchmark.dummy_model import write_dummy_model
from deploy.cluster import LocalCluster

# One prefill at a time in chunks of 16 tokens (25 steps for a 400-token prompt), one
# more waiting: a burst of 12 requests sent together (a barrier after their channels are
# up) finds the producer's queue full for most of its length, however loaded the machine.
PRODUCER_ARGS = ("--max-waiting", "1", "--max-num-seqs", "1")
WORKER_ARGS = ("--load-format", "dummy", "--max-num-batched-tokens", "16",
               "--kv-cache-mib", "32")
BURST, MAX_TOKENS, PROMPT_LEN = 12, 4, 400


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    model = write_dummy_model(str(tmp_path_factory.mktemp("busy-model")), "tiny")
    c = start_cluster(tmp_path_factory, "busy", model=model, worker_args=WORKER_ARGS,
                      producer_args=PRODUCER_ARGS)
    try:
        yield c
    finally:
        c.stop()


def _generate(address: str, i: int, start: threading.Barrier | None = None
              ) -> dict[str, Any]:
    """One request (once every thread of ``start`` has its channel up): its responses,
    then the call's status."""
    got: dict[str, Any] = {"responses": [], "code": grpc.StatusCode.OK, "details": "",
                           "trailers": {}}
    with grpc.insecure_channel(address) as ch:
        grpc.channel_ready_future(ch).result(timeout=30)
        if start is not None:
            start.wait(60)
        call = router_pb2_grpc.RouterStub(ch).Generate(router_pb2.GenerateRequest(
            prompt_token_ids=router_pb2.TokenIds(ids=list(range(200 + i,
                                                                200 + i + PROMPT_LEN))),
            sampling=common_pb2.SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)),
            timeout=120)
        try:
            for r in call:
                got["responses"].append(r)
        except grpc.RpcError as e:
            got["code"], got["details"] = e.code(), e.details()
            got["trailers"] = dict(e.trailing_metadata() or ())
    return got


def test_a_burst_past_the_producer_queue_is_completed_or_refused_up_front(
        cluster: LocalCluster) -> None:
    results: list[dict[str, Any]] = [{} for _ in range(BURST)]
    start = threading.Barrier(BURST)

    def one(i: int) -> None:
        results[i] = _generate(cluster.router_address, i, start)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(BURST)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(180)
    done = refused = 0
    for r in results:
        if r["code"] == grpc.StatusCode.OK:
            last = r["responses"][-1]
            assert last.finish_reason == common_pb2.FINISH_REASON_LENGTH, (last, dump_logs(
                cluster))
            assert sum(len(x.token_ids) for x in r["responses"]) == MAX_TOKENS
            done += 1
            continue
        # refused before the stream started: no response, a clear reason, a retry hint
        assert r["code"] == grpc.StatusCode.RESOURCE_EXHAUSTED, (r["code"], r["details"],
                                                                  dump_logs(cluster))
        assert r["responses"] == [], r["responses"]
        assert "producer worker-0" in r["details"], r["details"]
        assert "waiting queue is full" in r["details"], r["details"]
        assert r["trailers"].get("retry-after") == "1", r["trailers"]
        refused += 1
    assert done >= 1 and refused >= 1, (done, refused, dump_logs(cluster))
    # busy is not dead: the producer is still registered and the next request completes
    with grpc.insecure_channel(cluster.router_address) as ch:
        st = router_pb2_grpc.RouterStub(ch).ClusterStatus(router_pb2.ClusterStatusRequest(),
                                                         timeout=10)
    assert sorted(w.worker_id for w in st.workers) == ["worker-0", "worker-1"]
    after = _generate(cluster.router_address, 99)
    assert after["code"] == grpc.StatusCode.OK, after
    assert after["responses"][-1].finish_reason == common_pb2.FINISH_REASON_LENGTH
