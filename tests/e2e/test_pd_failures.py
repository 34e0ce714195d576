"""Killing a consumer or a producer mid-request ends its requests with a clear error (not a
hang), the router stops pairing with it, and the rest of the cluster keeps serving."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from cluster_client import chat, generate, stub_for, wait_for_full_kv
from live_cluster import start_cluster
from pdserve.v1 import common_pb2, router_pb2

LONG = "Paged KV blocks move from the producer to the consumer as prefill goes on. " * 60


def _workers(stub) -> set[str]:  # type: ignore[no-untyped-def]
    return {w.worker_id for w in stub.ClusterStatus(router_pb2.ClusterStatusRequest()).workers}


def _wait_decoding(stub, rids: list[str], timeout: float = 60.0) -> None:  # type: ignore[no-untyped-def]
    """Until every request in ``rids`` is decoding on its consumer (tokens streamed from it)."""
    end = time.monotonic() + timeout
    while True:
        st = stub.ClusterStatus(router_pb2.ClusterStatusRequest(include_requests=True))
        seen = {r.request_id: r for r in st.requests}
        if all(rid in seen and seen[rid].state == "DECODING" and seen[rid].tokens_streamed >= 2
               for rid in rids):
            return
        assert time.monotonic() < end, [seen.get(rid) for rid in rids]
        time.sleep(0.05)


def _wait_dropped(stub, name: str, timeout: float = 15.0) -> None:  # type: ignore[no-untyped-def]
    end = time.monotonic() + timeout
    while name in _workers(stub):
        assert time.monotonic() < end, f"{name} still registered"
        time.sleep(0.2)


@pytest.mark.parametrize("backend", ["ucx", "ipc"])
def test_killed_workers_fail_their_requests_and_are_dropped(tmp_path_factory, backend):
    # ipc: the consumer holds a mapping of the killed producer's pool and pulls from it
    # retries and migrations off: killed workers must fail their requests here
    # (test_pd_retry: retried, test_pd_migration: migrated)
    c = start_cluster(tmp_path_factory, f"ckill-{backend}", producers=2, consumers=2,
                      transfer_backend=backend, router_args=("--heartbeat-timeout", "2",
                                                             "--prefill-retries", "0",
                                                             "--max-migrations", "0"))
    ch, stub = stub_for(c.router_address)
    try:
        # --- a consumer dies mid-decode ------------------------------------------------
        # long enough to be still decoding well after the router shows it decoding (the kill
        # follows that within milliseconds); every token past that is the survivor's to
        # decode before the test goes on (150 took ~5 s more on a 2-core machine)
        decode = dict(max_tokens=64, temperature=0, ignore_eos=True)
        rids = [f"kill-{backend}-{i}" for i in range(2)]
        with ThreadPoolExecutor(2) as pool:
            futs = [pool.submit(generate, stub, decode, timeout=120, request_id=rid,
                                **chat(f"Count to a thousand, take {i}."))
                    for i, rid in enumerate(rids)]
            _wait_decoding(stub, rids)  # round robin: one per consumer
            t_kill = time.monotonic()
            # its gRPC process alone, as the OOM killer would: the engine must follow
            assert len(c.group_alive("worker-2")) >= 2
            c.kill("worker-2", group=False)
            results = [f.result() for f in futs]
        while c.group_alive("worker-2"):
            assert time.monotonic() - t_kill < 10, "the engine outlived its worker"
            time.sleep(0.1)
        failed = [r for r in results if r.finish_reason == common_pb2.FINISH_REASON_ERROR]
        ok = [r for r in results if r.finish_reason == common_pb2.FINISH_REASON_LENGTH]
        assert len(failed) == 1 and len(ok) == 1, [(r.finish_reason, r.error) for r in results]
        assert "worker-2" in failed[0].error
        assert len(ok[0].token_ids) == decode["max_tokens"]
        assert time.monotonic() - t_kill < 60  # ended, no hang (the survivor ran to the end)
        _wait_dropped(stub, "worker-2")
        after = [generate(stub, dict(max_tokens=3, temperature=0), **chat("Hi!"))
                 for _ in range(4)]
        assert all(r.error == "" and r.timing.consumer == "worker-3" for r in after)

        # --- a producer dies mid-prefill ------------------------------------------------
        prefill = dict(max_tokens=4, temperature=0)
        with ThreadPoolExecutor(4) as pool:
            futs = [pool.submit(generate, stub, prefill, timeout=120, **chat(LONG + str(i)))
                    for i in range(4)]
            time.sleep(0.8)
            c.kill("worker-0")
            results = [f.result() for f in futs]
        errors = [r.error for r in results if r.finish_reason == common_pb2.FINISH_REASON_ERROR]
        assert errors and all("worker-0" in e for e in errors), errors
        _wait_dropped(stub, "worker-0")
        r = generate(stub, prefill, **chat(LONG))
        assert r.error == "" and r.timing.producer == "worker-1"
        wait_for_full_kv(stub)  # the survivors' pools are whole
    finally:
        ch.close()
        c.stop()
