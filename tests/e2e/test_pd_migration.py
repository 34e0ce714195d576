"""A consumer failing mid-decode on a live cluster: the router migrates the
request to another consumer with the tokens already streamed, and the client gets exactly
the colocated engine's tokens, greedy and seeded (per-request randomness is a pure function
of (seed, position), kernels/random_draw.py). SIGKILL, and SIGSTOP past the heartbeat
deadline (the stopped worker, once continued, serves nothing of it)."""

from __future__ import annotations

import json
import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from cluster_client import generate, stub_for, wait_for_full_kv
from live_cluster import dump_logs, start_cluster
from pdserve.v1 import common_pb2, router_pb2

from engine.sampling_params import SamplingParams

CONSUMERS = ("worker-1", "worker-2", "worker-3")
GREEDY = dict(max_tokens=48, temperature=0.0, ignore_eos=True)
# penalties and min_tokens: the streamed tokens must come back as OUTPUT tokens
SEEDED = dict(max_tokens=48, temperature=0.9, top_p=0.95, seed=1234, frequency_penalty=0.4,
              presence_penalty=0.3, min_tokens=40)
# structured output: the new consumer's grammar resumes from the streamed tokens (a JSON
# array that cannot close within max_tokens, so the fault always lands inside it)
STRUCTURED = dict(max_tokens=48, temperature=0.9, seed=77, structured={
    "kind": "json_schema", "value": json.dumps({
        "type": "array", "items": {"type": "string", "maxLength": 12}, "minItems": 40})})
FINISH = {"stop": common_pb2.FINISH_REASON_STOP, "length": common_pb2.FINISH_REASON_LENGTH}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):  # type: ignore[no-untyped-def]
    c = start_cluster(tmp_path_factory, "cmigrate", producers=1, consumers=3,
                      router_args=("--heartbeat-timeout", "2"))
    yield c
    c.stop()


def _listed(stub, rid: str):  # type: ignore[no-untyped-def]
    st = stub.ClusterStatus(router_pb2.ClusterStatusRequest(include_requests=True))
    return next((r for r in st.requests if r.request_id == rid), None)


def _healthy(stub) -> set[str]:  # type: ignore[no-untyped-def]
    return {w.worker_id for w in stub.ClusterStatus(router_pb2.ClusterStatusRequest()).workers
            if w.healthy}


def _consumers(stub) -> set[str]:  # type: ignore[no-untyped-def]
    return _healthy(stub) & set(CONSUMERS)


def _wait_for(pred, what: str, timeout: float):  # type: ignore[no-untyped-def]
    end = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < end, what
        time.sleep(0.2)


def _fault_mid_decode(cluster, stub, colocated_llm, sampling, rid, fault):  # type: ignore[no-untyped-def]
    """Runs one request, applies ``fault`` to its consumer once 5+ tokens are out; checks
    the client's tokens against the colocated engine. Returns (victim, result, seconds
    from the fault to the end)."""
    tok = colocated_llm.tokenizer
    prompt = tok.encode_chat([{"role": "user", "content": f"Tell a long story ({rid})."}])
    ref = colocated_llm.generate([prompt], [SamplingParams(**sampling)])[0]
    with ThreadPoolExecutor(1) as pool:
        fut = pool.submit(generate, stub, sampling, timeout=300, request_id=rid,
                          prompt_token_ids=router_pb2.TokenIds(ids=prompt))
        end = time.monotonic() + 120
        while True:
            seen = _listed(stub, rid)
            if seen is not None and seen.state == "DECODING" and seen.tokens_streamed >= 5:
                break
            assert not fut.done(), fut.result()
            assert time.monotonic() < end, seen
            time.sleep(0.01)
        victim = seen.consumer
        assert victim in CONSUMERS and seen.tokens_streamed < len(ref.token_ids), seen
        t_fault = time.monotonic()
        fault(victim)
        r = fut.result()
        took = time.monotonic() - t_fault
    assert r.code is None and r.error == "", (r.code, r.details, r.error, dump_logs(cluster))
    assert r.timing.consumer not in ("", victim) and r.timing.producer == "worker-0"
    assert r.token_ids == ref.token_ids  # no repeat, no gap, same tokens as unfailed
    assert r.text == ref.text
    assert r.finish_reason == FINISH[ref.finish_reason]
    assert r.usage.completion_tokens == len(ref.token_ids)
    return victim, r, took


@pytest.mark.parametrize("sampling", [GREEDY, SEEDED, STRUCTURED],
                         ids=["greedy", "seeded", "structured"])
def test_consumer_sigkill_mid_decode_migrates(cluster, colocated_llm, sampling):
    ch, stub = stub_for(cluster.router_address)
    try:
        rid = f"kill-{len(sampling)}-{sampling['temperature']}"  # one per parameter set
        victim, _, _ = _fault_mid_decode(cluster, stub, colocated_llm, sampling, rid,
                                         cluster.kill)
        # the survivors' pools are whole; the producer and the other consumers serve on
        wait_for_full_kv(stub, timeout=60)
        assert victim not in _healthy(stub)
        if len(_consumers(stub)) < 2:  # the next test needs one to move to: respawn one
            cluster.respawn(victim)  # (once per module: a respawn costs a model load)
            _wait_for(lambda: victim in _healthy(stub), "respawned consumer", 180)
    finally:
        ch.close()


def test_consumer_sigstop_past_heartbeat_deadline_moves_and_is_not_double_serving(
        cluster, colocated_llm):
    ch, stub = stub_for(cluster.router_address)
    stopped: list[int] = []

    def sigstop(name: str) -> None:
        os.killpg(cluster.procs[name].pid, signal.SIGSTOP)  # its engine too
        stopped.append(cluster.procs[name].pid)

    try:
        _wait_for(lambda: len(_consumers(stub)) >= 2, "two consumers", 180)
        serving = _consumers(stub)
        victim, _, took = _fault_mid_decode(cluster, stub, colocated_llm, GREEDY, "stopped",
                                            sigstop)
        # dropped at the 2 s heartbeat deadline, then the rest decoded elsewhere: well
        # within the request's 300 s token timeout (generous: a loaded 2-core CI machine)
        assert took < 120, took
        assert victim not in _healthy(stub)
        os.killpg(stopped.pop(), signal.SIGCONT)
        # it comes back (its heartbeat is refused, it registers again) holding nothing:
        # the router cancelled its stream, so the request was aborted there, not finished
        _wait_for(lambda: victim in _healthy(stub), "continued consumer re-registered", 60)
        workers = wait_for_full_kv(stub, timeout=60)
        assert victim in {w.worker_id for w in workers}
        v = next(w for w in workers if w.worker_id == victim)
        assert v.load.running == 0 and v.load.waiting == 0
        # Its first heartbeats after SIGCONT report the stop as event-loop lag, so for a
        # heartbeat or two it is busy (no new requests): wait until it has caught up.
        _wait_for(lambda: any(w.worker_id == victim and w.load.loop_lag_s < 1.0
                              for w in stub.ClusterStatus(router_pb2.ClusterStatusRequest(),
                                                          timeout=30).workers),
                  "continued consumer caught up", 30)
        # and it serves new requests normally
        rs = [generate(stub, dict(max_tokens=3, temperature=0.0),
                       prompt_token_ids=router_pb2.TokenIds(ids=[1, 2, 3, 4]))
              for _ in range(len(serving))]
        assert all(r.error == "" and len(r.token_ids) == 3 for r in rs), [r.error for r in rs]
        assert victim in {r.timing.consumer for r in rs}  # round robin over all of them
    finally:
        for pid in stopped:
            os.killpg(pid, signal.SIGCONT)
        ch.close()
