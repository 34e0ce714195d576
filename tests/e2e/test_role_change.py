"""Live role changes on a 2-worker CPU cluster under steady load: `pdserve plan apply` moves
1P1D to 2 colocated and back; no request is lost and every request's tokens equal the
colocated engine's. Each changed worker keeps its id and address, and drained its requests
before it changed."""

from __future__ import annotations

import re

import pytest
from live_cluster import start_cluster
from pdserve.v1 import common_pb2
from steady_load import (
    SteadyLoad,
    check_against_colocated,
    log_text,
    tiny_served_model,
    wait_decoding,
    workers,
)

from deploy.cli import main

WORKER_ARGS = ("--max-num-batched-tokens", "32", "--kv-cache-mib", "16")
# heartbeats (and the orders polled with them) 4x a second: a worker learns of its role
# change, and the router sees its load, within a quarter second
HEARTBEAT_S = "0.25"
P, C, X = common_pb2.ROLE_PRODUCER, common_pb2.ROLE_CONSUMER, common_pb2.ROLE_COLOCATED


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> str:
    return tiny_served_model(str(tmp_path_factory.mktemp("tiny")))


def test_1p1d_to_2_colocated_and_back_under_load(tmp_path_factory, tiny_model, capsys):
    from engine.llm import LLM

    c = start_cluster(tmp_path_factory, "roles", producers=1, consumers=1, model=tiny_model,
                      threads=1, worker_args=WORKER_ARGS,
                      router_args=("--heartbeat-timeout", "3", "--heartbeat-interval",
                                   HEARTBEAT_S))
    try:
        before = {w.worker_id: w.address for w in workers(c).values()}
        # long enough that a change always finds requests in flight: the worker learns of its
        # order at its next heartbeat (every 0.25 s here), and shorter requests may all have
        # ended by then; the longest still runs for seconds, many heartbeats
        load = SteadyLoad(c.router_address, clients=3, max_tokens=(200, 600, 2000))
        with load.running():
            load.wait_for(6)
            # the worker learns of its order at its next heartbeat (0.25 s) and then drains
            wait_decoding(c, "consumer-0", 1000)
            assert main(["plan", "apply", "--router", c.router_address, "--producers", "0",
                         "--consumers", "0", "--colocated", "2"]) == 0
            ws = workers(c)
            assert {w: s.role for w, s in ws.items()} == {"producer-0": X, "consumer-0": X}
            assert {w: s.address for w, s in ws.items()} == before  # same identity and port
            assert not any(s.draining for s in ws.values())
            n_colocated = load.count()
            load.wait_for(6)
            assert main(["plan", "apply", "--router", c.router_address, "--producers", "1",
                         "--consumers", "1"]) == 0
            ws = workers(c)
            assert sorted(s.role for s in ws.values()) == [P, C]
            assert ws["producer-0"].kv_fingerprint == ws["consumer-0"].kv_fingerprint
            load.wait_for(6)
        out = capsys.readouterr().out
        assert "consumer-0: consumer -> colocated: registered" in out
        assert "producer-0: producer -> colocated: registered" in out
        assert out.count("role change done (2 step(s))") == 2
        assert load.count() >= 18
        check_against_colocated(load.sent, LLM(tiny_model, max_num_batched_tokens=32))
        # served colocated in between, and by a P/D pair before and after
        legs = [(bool(s.result.timing.colocated), i) for i, s in enumerate(load.sent)]
        assert any(colo for colo, i in legs if i >= n_colocated)
        assert not legs[0][0] and not legs[-1][0]
        logs = log_text(c, "producer-0") + log_text(c, "consumer-0")
        assert logs.count("the router ordered a role change") == 4
        assert re.search(r"waiting for [1-9]", logs), \
            "no role change had a request in flight to drain"
    finally:
        c.stop()
