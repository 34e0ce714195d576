"""Chaos: steady load against a live 2P2D cluster while a driver SIGKILLs and
SIGSTOPs workers and throws junk at KV ports (tests/chaos/chaos_driver.py). At the end:
every request ended with its tokens or a clear error within its deadline, none was lost
silently, every completed one (migrated and retried ones included) has the colocated
engine's tokens, no worker died of input, and once quiet no worker holds a KV block.

About 30 s of load (a fault every ~5 s, the three kinds in turn: five or six faults, so
every kind at least once and most twice, each with requests in flight; a fault waits for
its role to be whole again, so they pace themselves to recovery); ``PDSERVE_CHAOS_S``
changes it (bench/chaos_soak.py runs for minutes),
``PDSERVE_CHAOS_SEED`` replays a run (the seed is printed)."""

from __future__ import annotations

import json
import os
import random

import pytest
from chaos.chaos_driver import ChaosRun
from live_cluster import dump_logs, start_cluster

pytestmark = pytest.mark.slow

# short silences end or move requests fast; short lease/reservation deadlines free what a
# dead peer left well within the quiesce wait
ROUTER_ARGS = ("--heartbeat-timeout", "2", "--token0-timeout", "40", "--token-timeout", "20",
               "--max-migrations", "3", "--prefill-retries", "3")


def test_chaos_2p2d(tmp_path_factory, chaos_cases):
    seed = int(os.environ.get("PDSERVE_CHAOS_SEED", random.randrange(1 << 30)))
    duration = float(os.environ.get("PDSERVE_CHAOS_S", "30"))
    print(f"chaos seed {seed}, {duration:g} s")
    cases = chaos_cases
    c = start_cluster(tmp_path_factory, "chaos", producers=2, consumers=2,
                      router_args=ROUTER_ARGS)
    try:
        run = ChaosRun(c, cases, seed=seed, clients=4, deadline_s=90.0, fault_every_s=5.0)
        run.run(duration)
        leaked = run.quiesce(timeout_s=150.0)
        record = run.record(leaked)
        print(json.dumps({k: v for k, v in record.items() if k != "faults"}, indent=1))
        assert not record["violations"], (record["violations"], dump_logs(c))
        assert all(n == 0 for n in leaked.values()), (leaked, dump_logs(c))
        # the run really was chaotic and really served
        assert set(record["faults_injected"]) == {"sigkill", "sigstop", "hostile"}, record
        assert record["requests_ok"] >= 4, record  # at least one per client
    finally:
        c.stop()
