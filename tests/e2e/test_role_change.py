"""Live role changes on a CPU cluster: `pdserve plan apply` moves 1P1D to 2 colocated and
back under steady load (no request is lost and every request's tokens equal the colocated
engine's; each changed worker keeps its id and address, and drained its requests before it
changed), and moves 2P1D to 1P2D as a planned change: the router lists the rebuilt worker
under its role-neutral id in its new role and logs the rebuild as planned, never as a
lost worker."""

from __future__ import annotations

import re
import threading
import time

import pytest
from cluster_client import generate, stub_for
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
        outputs_before = {w.worker_id: w.outputs_address for w in workers(c).values()}
        assert all(outputs_before.values()), outputs_before
        # long enough that a change finds requests in flight: the worker learns of its order
        # at its next heartbeat (every 0.25 s here), and the longest request still runs for
        # seconds after that (300+ tokens left at a few hundred tokens/s on a 2-core
        # machine), many heartbeats. Each extra token costs twice (the cluster, then the
        # colocated reference at the end), so no longer than that.
        load = SteadyLoad(c.router_address, clients=3, max_tokens=(64, 200, 600))
        with load.running():
            load.wait_for(6)
            assert main(["plan", "apply", "--router", c.router_address, "--producers", "0",
                         "--consumers", "0", "--colocated", "2"]) == 0
            ws = workers(c)
            assert {w: s.role for w, s in ws.items()} == {"worker-0": X, "worker-1": X}
            assert {w: s.address for w, s in ws.items()} == before  # same identity and port
            assert {w: s.outputs_address for w, s in ws.items()} == outputs_before
            assert not any(s.draining for s in ws.values())
            n_colocated = load.count()
            load.wait_for(6)
            # The worker changed first learns of its order at its next heartbeat (0.25 s),
            # then waits 0.5 s for calls in transit before it counts what is in flight: a
            # colocated request with 400 tokens to go outlasts that on any machine. Which of
            # the two the plan changes first is its choice, so both must hold one. (Going to
            # colocated, the producer changes first and the consumer only after the
            # producer's rebuild, seconds later: nothing it decodes lasts that long.)
            wait_decoding(c, ("worker-0", "worker-1"), 400)
            assert main(["plan", "apply", "--router", c.router_address, "--producers", "1",
                         "--consumers", "1"]) == 0
            ws = workers(c)
            assert sorted(s.role for s in ws.values()) == [P, C]
            assert ws["worker-0"].kv_fingerprint == ws["worker-1"].kv_fingerprint
            load.wait_for(6)
        out = capsys.readouterr().out
        assert "worker-1: consumer -> colocated: registered" in out
        assert "worker-0: producer -> colocated: registered" in out
        assert out.count("role change done (2 step(s))") == 2
        assert load.count() >= 18
        check_against_colocated(load.sent, LLM(tiny_model, max_num_batched_tokens=32))
        # served colocated in between, and by a P/D pair before and after
        legs = [(bool(s.result.timing.colocated), i) for i, s in enumerate(load.sent)]
        assert any(colo for colo, i in legs if i >= n_colocated)
        assert not legs[0][0] and not legs[-1][0]
        logs = log_text(c, "worker-0") + log_text(c, "worker-1")
        assert logs.count("the router ordered a role change") == 4
        assert re.search(r"changing role to (producer|consumer)\): [1-9][0-9]* request\(s\) "
                         r"in flight at the start", logs), \
            "the change back to P/D had no request in flight to drain"
        # four planned rebuilds under load, and not one logged as a lost worker
        router = log_text(c, "router")
        assert router.count("as planned") >= 1 and router.count("registered again, now") == 4
        assert not re.search(r"dropp|no heartbeat|stopped heartbeating", router), router
    finally:
        c.stop()


# Past this, a silent worker would be dropped; the rebuild below is silent longer than that.
SILENCE_TIMEOUT_S = 2.0


class StatusWatch:
    """Polls the router's worker listing from a thread while a change runs: when the changed
    worker was first seen ordered to change, when first seen back in its new role, and
    whether any poll found it missing (dropped)."""

    def __init__(self, c, worker: str, to_role: int) -> None:  # type: ignore[no-untyped-def]
        self.c, self.worker, self.to_role = c, worker, to_role
        self.ordered_at = self.back_at = 0.0
        self.missing: list[float] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self.stop.is_set() and not self.back_at:
            ws = workers(self.c)
            now = time.monotonic()
            w = ws.get(self.worker)
            if w is None:
                self.missing.append(now)
            elif w.draining and w.target_role == self.to_role and not self.ordered_at:
                self.ordered_at = now
            elif self.ordered_at and w.role == self.to_role and not w.draining:
                self.back_at = now
            time.sleep(0.05)


def test_a_planned_role_change_keeps_the_name_and_logs_as_planned(tmp_path_factory, tiny_model,
                                                                  capsys):
    """2P1D -> 1P2D: worker-0 (the idle first producer) becomes a consumer. Its rebuild is
    silent for longer than the heartbeat timeout, yet the router never drops it, and its log
    tells the change as planned; afterwards worker-0 is listed as a consumer at the same
    address and decodes requests."""
    c = start_cluster(tmp_path_factory, "roles-named", producers=2, consumers=1,
                      model=tiny_model, threads=1, worker_args=WORKER_ARGS,
                      router_args=("--heartbeat-timeout", str(SILENCE_TIMEOUT_S),
                                   "--heartbeat-interval", HEARTBEAT_S))
    try:
        before = workers(c)
        assert {w: s.role for w, s in before.items()} == \
            {"worker-0": P, "worker-1": P, "worker-2": C}
        watch = StatusWatch(c, "worker-0", C)
        watch.thread.start()
        try:
            assert main(["plan", "apply", "--router", c.router_address, "--producers", "1",
                         "--consumers", "2"]) == 0
            # `plan apply` returns once the router has the worker back; the watch's next poll
            # (every 0.05 s) sees that too, and its thread ends there. Stopping it now instead
            # raced that last poll (it could end without ever seeing the worker back).
            watch.thread.join(15)
        finally:
            watch.stop.set()
            watch.thread.join(15)
        out = capsys.readouterr().out
        assert "worker-0: producer -> consumer: registered" in out, out
        # (1) the listing: the same name and address, the new role, serving
        after = workers(c)
        assert {w: s.role for w, s in after.items()} == \
            {"worker-0": C, "worker-1": P, "worker-2": C}
        assert {w: s.address for w, s in after.items()} == \
            {w: s.address for w, s in before.items()}
        assert not any(s.draining for s in after.values()) and all(s.healthy
                                                                  for s in after.values())
        assert after["worker-0"].kv_address and \
            after["worker-0"].kv_fingerprint == after["worker-2"].kv_fingerprint
        # it was silent past the timeout (ordered .. back in its role), and listed throughout
        assert watch.ordered_at and watch.back_at, (watch.ordered_at, watch.back_at)
        assert watch.back_at - watch.ordered_at > SILENCE_TIMEOUT_S, \
            watch.back_at - watch.ordered_at
        assert not watch.missing, f"worker-0 missing from the listing {len(watch.missing)}x"
        # (2) the router's log: the change, told as planned; no drop of any kind
        router = log_text(c, "router")
        for line in ("role change: worker-0 (producer) leaves for a planned change to "
                     "consumer: draining",
                     "role change: worker-0 is rebuilding as a consumer: silent until it "
                     "registers again, as planned",
                     "registered consumer worker-0 at ",
                     "role change: worker-0 registered again, now a consumer (planned: "
                     "worker-0: producer -> consumer)",
                     "role change done (1 step(s))"):
            assert line in router, (line, router)
        alarming = [ln for ln in router.splitlines()
                    if re.search(r"dropp|no heartbeat|stopped heartbeating|lost|failed", ln)]
        assert not alarming, alarming
        # the new consumer decodes: round robin over the two consumers reaches it
        ch, stub = stub_for(c.router_address)
        with ch:
            rs = [generate(stub, dict(max_tokens=4, temperature=0), prompt=f"hello {i}")
                  for i in range(4)]
        assert all(r.error == "" and len(r.token_ids) == 4 for r in rs), rs
        assert {r.timing.consumer for r in rs} == {"worker-0", "worker-2"}, rs
    finally:
        c.stop()
