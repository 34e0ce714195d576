"""Backpressure slows the cluster, it does not fail requests: a 1P1D cluster
whose consumer's KV pool holds one long request at a time, offered many at once, with the
producer's lease cut to 2 s. Every reservation but the first waits for blocks far longer
than the lease; the router's holds keep the producer's prefilled blocks, so every request
completes with the colocated engine's tokens and no lease expires. A consumer that goes
silent while reservations wait (SIGSTOP past the heartbeat deadline) still frees the
producer's blocks in bounded time, because the holds stop with it."""

from __future__ import annotations

import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from cluster_client import chat, generate, stub_for, wait_for_full_kv
from live_cluster import dump_logs, start_cluster
from pdserve.v1 import router_pb2

from engine.sampling_params import SamplingParams

pytestmark = pytest.mark.slow

LEASE_S = 2.0
HEARTBEAT_S = 3.0
BIG = "Reservations wait for blocks when the consumer's pool is full. " * 32  # ~400 tokens
N = 8


@pytest.fixture(scope="module")
def tight_cluster(tmp_path_factory):  # type: ignore[no-untyped-def]
    # the consumer: 40 blocks of 16 tokens, one ~400-token request at a time; the producer:
    # room to prefill them all and hold them while they wait
    c = start_cluster(tmp_path_factory, "cbpl",
                      worker_args=("--num-kv-blocks", "40", "--max-num-batched-tokens", "128",
                                   # the pool pressure is the point: no cached prefix relieves it
                                   "--no-enable-prefix-caching"),
                      producer_args=("--num-kv-blocks", "400", "--lease", str(LEASE_S)),
                      router_args=("--local-prefill-max-tokens", "-1",  # the P/D path only
                                   "--hold-interval", "0.5", "--token0-timeout", "300",
                                   "--heartbeat-timeout", str(HEARTBEAT_S),
                                   "--max-migrations", "0"))
    yield c
    c.stop()


def _log(c, name: str) -> str:  # type: ignore[no-untyped-def]
    with open(c.log_paths[name], errors="replace") as f:
        return f.read()


def _load(stub, worker: str):  # type: ignore[no-untyped-def]
    ws = stub.ClusterStatus(router_pb2.ClusterStatusRequest()).workers
    return next((w.load for w in ws if w.worker_id == worker), None)


def test_queued_reservations_outlive_the_lease(tight_cluster, colocated_llm):
    c = tight_cluster
    ch, stub = stub_for(c.router_address)
    prompts = [BIG + f"Request {i}." for i in range(N)]
    params = dict(max_tokens=40, temperature=0, ignore_eos=True)
    try:
        with ThreadPoolExecutor(N) as pool:
            futs = [pool.submit(generate, stub, params, 300, **chat(p)) for p in prompts]
            results = [f.result() for f in futs]
        refs = colocated_llm.generate(prompts, SamplingParams(**params), chat=True)
        for r, ref in zip(results, refs, strict=True):
            assert r.error == "" and not r.code, (r.error, r.code, r.details, dump_logs(c))
            assert r.token_ids == ref.token_ids
        # how long each waited, after token 0, for the consumer's reservation: from token 0
        # to the KV landing, less the transfer itself
        waits = sorted((r.timing.consumer_kv_ready_ns - r.timing.producer_token0_sampled_ns)
                       / 1e9 - r.timing.kv_transfer_ms / 1e3 for r in results)
        assert waits[-1] > 1.5 * LEASE_S, waits  # past the lease: held on the router's word
        plog = _log(c, "worker-0")
        assert "lease expired" not in plog, plog[-3000:]
        assert "lease expired" not in _log(c, "router")
        wait_for_full_kv(stub, timeout=30)
    finally:
        ch.close()


def test_a_silent_consumer_still_frees_the_producer_blocks(tight_cluster):
    c = tight_cluster
    ch, stub = stub_for(c.router_address)
    prompts = [BIG + f"Stopped {i}." for i in range(4)]
    try:
        with ThreadPoolExecutor(4) as pool:
            futs = [pool.submit(generate, stub, dict(max_tokens=100, temperature=0,
                                                     ignore_eos=True), 120, **chat(p))
                    for p in prompts]
            end = time.monotonic() + 60
            while True:  # reservations queued on the consumer, prefilled blocks on the producer
                cl, pl = _load(stub, "worker-1"), _load(stub, "worker-0")
                if cl is not None and pl is not None and cl.waiting >= 1 \
                        and pl.kv_blocks_free < pl.kv_blocks_total:
                    break
                assert time.monotonic() < end, (cl, pl)
                time.sleep(0.1)
            os.killpg(c.procs["worker-1"].pid, signal.SIGSTOP)
            stopped = time.monotonic()
            try:
                results = [f.result() for f in futs]
                # every request ends, with a clear error (no other consumer to move to)
                assert all(r.error or r.code for r in results), results
                # and the producer holds nothing while the consumer is still silent
                while True:
                    pl = _load(stub, "worker-0")
                    if pl is not None and pl.kv_blocks_free == pl.kv_blocks_total \
                            and pl.transfers_in_flight == 0:
                        break
                    assert time.monotonic() - stopped < HEARTBEAT_S + LEASE_S + 20, pl
                    time.sleep(0.2)
            finally:
                os.killpg(c.procs["worker-1"].pid, signal.SIGCONT)
        wait_for_full_kv(stub, timeout=60)
    finally:
        ch.close()
