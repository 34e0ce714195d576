"""Graceful drain on a live cluster: SIGTERM deregisters a worker (the router stops picking
it), its in-flight requests finish, it exits 0; a rolling restart of every worker of a 2P2D
cluster under steady load loses no request, and every request's tokens equal the colocated
engine's. Past --drain-timeout, what still runs ends with an error naming it."""

from __future__ import annotations

import os
import re
import signal
import time

import grpc
import pytest
from cluster_client import generate, stub_for
from live_cluster import start_cluster
from pdserve.v1 import common_pb2, router_pb2, worker_pb2, worker_pb2_grpc
from steady_load import (
    PROMPTS,
    SteadyLoad,
    check_against_colocated,
    log_text,
    tiny_served_model,
    wait_decoding,
    wait_until,
    workers,
)

from deploy.cluster import LocalCluster

WORKER_ARGS = ("--max-num-batched-tokens", "32", "--kv-cache-mib", "16")
HEARTBEAT_S = "0.25"
# A consumer is drained only once the router shows it decoding a request with this many tokens
# still to stream: the drain's deregistration and in-transit grace (0.5 s) pass well inside
# them, even on a fast machine.
DRAIN_LEFT = 400
LONG_TOKENS = 24000


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> str:
    return tiny_served_model(str(tmp_path_factory.mktemp("tiny")))


@pytest.fixture(scope="module")
def long_model(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The tiny model with room for a request that outlives any drain timeout: 3900 tokens
    took under 5 s on a quiet 2-core machine, and did not."""
    return tiny_served_model(str(tmp_path_factory.mktemp("tinylong")), max_len=32768)


@pytest.fixture(scope="module")
def tiny_llm(tiny_model: str):  # type: ignore[no-untyped-def]
    from engine.llm import LLM

    return LLM(tiny_model, max_num_batched_tokens=32)


def sigterm(c: LocalCluster, name: str, group: bool = False) -> None:
    """SIGTERM to the worker's own process (as Kubernetes and `kill` do), or to its whole
    process group, engine process included (as scancel does): both drain."""
    if group:
        os.killpg(c.procs[name].pid, signal.SIGTERM)
    else:
        c.procs[name].send_signal(signal.SIGTERM)


def test_rolling_restart_2p2d_under_load_loses_no_request(tmp_path_factory, tiny_model,
                                                          tiny_llm):
    c = start_cluster(tmp_path_factory, "roll", producers=2, consumers=2, model=tiny_model,
                      threads=1, worker_args=WORKER_ARGS,
                      router_args=("--heartbeat-timeout", "3", "--heartbeat-interval",
                                   HEARTBEAT_S, "--policy", "round_robin"))
    try:
        # the longest leaves room for DRAIN_LEFT once the router shows it decoding; each token
        # costs twice (the cluster, then the colocated reference at the end)
        load = SteadyLoad(c.router_address, clients=3, max_tokens=(32, 150, 600))
        with load.running():
            load.wait_for(8)
            for i, name in enumerate(("worker-0", "worker-2", "worker-1", "worker-3")):
                old = c.procs[name]
                if c.started_as[name] == "consumer":
                    wait_decoding(c, name, DRAIN_LEFT)
                sigterm(c, name, group=i >= 2)
                # the router stops picking it at once, while it is still listed
                wait_until(lambda n=name: n not in workers(c) or workers(c)[n].draining,
                           10, f"{name} draining")
                assert old.wait(60) == 0, f"{name} did not drain and exit 0"
                wait_until(lambda n=name: n not in workers(c), 10, f"{name} deregistered")
                c.respawn(name)
                wait_until(lambda n=name: n in workers(c) and not workers(c)[n].draining,
                           120, f"{name} back")
                load.wait_for(4)  # the restarted cluster serves before the next goes
        assert load.count() >= 24
        check_against_colocated(load.sent, tiny_llm)
        # the drains were real: requests were in flight on the draining workers
        logs = "".join(log_text(c, n) for n in ("worker-0", "worker-2", "worker-1",
                                                 "worker-3"))
        assert logs.count("drained (SIGTERM)") == 4
        for name in ("worker-2", "worker-3"):
            # counted as the drain began: one that ended during the deregistration's grace
            # (0.5 s) was still a request the drain let finish
            assert re.search(r"[1-9][0-9]* request\(s\) in flight at the start",
                             log_text(c, name)), f"{name}'s drain began with nothing in flight"
    finally:
        c.stop()


def test_draining_worker_refuses_new_calls_and_ends_what_outlives_the_timeout(
        tmp_path_factory, long_model):
    c = start_cluster(tmp_path_factory, "drain-timeout", producers=0, consumers=0,
                      colocated=1, model=long_model, threads=1,
                      worker_args=(*WORKER_ARGS, "--drain-timeout", "4",
                                   "--max-model-len", str(LONG_TOKENS + 576)),
                      router_args=("--heartbeat-timeout", "3"))
    ch, stub = stub_for(c.router_address)
    try:
        address = workers(c)["worker-0"].address
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(1) as pool:
            # far longer than the drain timeout on any CPU (12 MiB of its 16 MiB KV pool)
            long = pool.submit(generate, stub, dict(max_tokens=LONG_TOKENS, temperature=0.0,
                                                    ignore_eos=True),
                               prompt_token_ids=router_pb2.TokenIds(ids=PROMPTS[1]))
            wait_until(lambda: workers(c)["worker-0"].load.running == 1, 30, "decoding")
            t0 = time.monotonic()
            sigterm(c, "worker-0")
            wait_until(lambda: workers(c)["worker-0"].draining, 10, "draining")
            # the router will not place a request: its only worker is draining
            r = generate(stub, dict(max_tokens=2), prompt_token_ids=router_pb2.TokenIds(
                ids=PROMPTS[0]))
            assert r.code == grpc.StatusCode.UNAVAILABLE, (r.code, r.details)
            # a call straight to the worker is refused, saying why
            time.sleep(0.6)  # past the in-transit grace
            with grpc.insecure_channel(address) as wch:
                with pytest.raises(grpc.RpcError) as e:
                    list(worker_pb2_grpc.WorkerStub(wch).Decode(worker_pb2.DecodeRequest(
                        request_id="late", prompt_token_ids=PROMPTS[0], colocated=True,
                        sampling=common_pb2.SamplingParams(max_tokens=2)), timeout=10))
            assert e.value.code() == grpc.StatusCode.UNAVAILABLE
            assert "worker-0 is draining (SIGTERM)" in e.value.details()
            with grpc.insecure_channel(address) as wch:  # and so is a request started alone
                with pytest.raises(grpc.RpcError) as e:
                    worker_pb2_grpc.WorkerStub(wch).StartDecode(worker_pb2.DecodeRequest(
                        request_id="late2", prompt_token_ids=PROMPTS[0], colocated=True,
                        subscriber_id="any", sampling=common_pb2.SamplingParams(max_tokens=2)),
                        timeout=10)
            assert e.value.code() == grpc.StatusCode.UNAVAILABLE
            assert "worker-0 is draining (SIGTERM)" in e.value.details()
            res = long.result(120)
        assert res.finish_reason == common_pb2.FINISH_REASON_ERROR, (res.code, res.details)
        assert "drain timeout (4 s, --drain-timeout)" in res.error, res.error
        assert 0 < len(res.token_ids) < LONG_TOKENS
        assert c.procs["worker-0"].wait(30) == 0
        assert time.monotonic() - t0 < 30
        wait_until(lambda: "worker-0" not in workers(c), 10, "deregistered")
    finally:
        ch.close()
        c.stop()
