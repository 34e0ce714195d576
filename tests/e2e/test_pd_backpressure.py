"""A consumer whose KV pool is full queues reservations (backpressure) instead of failing;
a queued request completes once blocks free up, and aborting it while queued frees both
sides."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from cluster_client import chat, generate, stub_for, wait_for_full_kv
from live_cluster import start_cluster
from pdserve.v1 import common_pb2, router_pb2

from engine.sampling_params import SamplingParams

BIG = "Reservations wait for blocks when the consumer's pool is full. " * 32  # ~400 tokens


def _consumer_waiting(stub) -> int:  # type: ignore[no-untyped-def]
    ws = stub.ClusterStatus(router_pb2.ClusterStatusRequest()).workers
    return sum(w.load.waiting for w in ws if w.role == common_pb2.ROLE_CONSUMER)


@pytest.fixture(scope="module")
def small_cluster(tmp_path_factory):  # type: ignore[no-untyped-def]
    # 40 blocks of 16 tokens: one ~400-token request decoding leaves no room for a second.
    # A 1 s transfer timeout: waiting for a turn must not count against it.
    # The requests share a long prefix: a consumer holding it would prefill the short rest
    # itself (conditional disaggregation), which is not the path under test here.
    c = start_cluster(tmp_path_factory, "cbp",
                      worker_args=("--num-kv-blocks", "40", "--max-num-batched-tokens", "32",
                                   # the pool pressure is the point: no cached prefix relieves it
                                   "--no-enable-prefix-caching",
                                   "--transfer-timeout", "1"),
                      router_args=("--local-prefill-max-tokens", "-1"))
    yield c
    c.stop()


def test_request_queued_on_the_producer_outlives_the_transfer_timeout(small_cluster,
                                                                      colocated_llm):
    ch, stub = stub_for(small_cluster.router_address)
    try:
        with ThreadPoolExecutor(2) as pool:
            long = pool.submit(generate, stub, dict(max_tokens=2, temperature=0),
                               **chat(BIG + "L"))
            time.sleep(0.2)
            short = pool.submit(generate, stub, dict(max_tokens=4, temperature=0),
                                **chat("What is the capital of France?"))
            rl, rs = long.result(), short.result()
        assert rl.error == "" and rs.error == "", (rl.error, rs.error)
        waited_s = (rs.timing.producer_token0_sampled_ns - rs.timing.router_received_ns) / 1e9
        assert waited_s > 1.0  # it queued behind the long prefill for longer than the timeout
        ref = colocated_llm.generate(["What is the capital of France?"],
                                     SamplingParams(max_tokens=4, temperature=0), chat=True)[0]
        assert rs.token_ids == ref.token_ids
        wait_for_full_kv(stub)
    finally:
        ch.close()


def test_full_consumer_queues_reservations(small_cluster, colocated_llm):
    c = small_cluster
    ch, stub = stub_for(c.router_address)
    try:
        with ThreadPoolExecutor(3) as pool:
            a = pool.submit(generate, stub, dict(max_tokens=120, temperature=0, ignore_eos=True),
                            **chat(BIG + "A"))
            time.sleep(2.0)
            b = pool.submit(generate, stub, dict(max_tokens=4, temperature=0), **chat(BIG + "B"))
            end = time.monotonic() + 30
            while _consumer_waiting(stub) < 1:  # B's reservation is queued (RESERVING)
                assert time.monotonic() < end and not b.done(), "B was never queued"
                time.sleep(0.1)
            # C queues behind B; cancel it while it waits for blocks.
            req = router_pb2.GenerateRequest(**chat(BIG + "C"))
            req.sampling.max_tokens = 4
            call = stub.Generate(req, timeout=60)
            threading.Timer(1.0, call.cancel).start()
            got_c = []
            try:
                got_c = list(call)
            except Exception:  # noqa: BLE001 - the cancel surfaces as an RpcError
                pass
            ra, rb = a.result(), b.result()
        assert not any(m.finish_reason for m in got_c)
        assert ra.error == "" and len(ra.token_ids) == 120
        ref = colocated_llm.generate([BIG + "B"], SamplingParams(max_tokens=4, temperature=0),
                                     chat=True)[0]
        assert rb.error == "" and rb.token_ids == ref.token_ids  # it waited, then completed
        assert rb.timing.consumer_kv_ready_ns > ra.timing.router_token0_sent_ns
        wait_for_full_kv(stub)
    finally:
        ch.close()
