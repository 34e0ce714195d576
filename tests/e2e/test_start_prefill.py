"""StartPrefill on a real producer, called directly (no router in the path): token 0 and the
transfer's result come on the Outputs stream it names, in order; PrefillControl carries the
consumer's reservation, and the KV lands on a real consumer, whose tokens continue token 0
as one colocated stream gives them; refusals are the call's status, naming the field; Abort
and the end of the Outputs stream end a started request and free its blocks."""

from __future__ import annotations

import re
import urllib.request
from collections.abc import Callable, Iterator
from typing import Any

import grpc
import pytest
from cluster_client import wait_whole
from pdserve.v1 import common_pb2, worker_pb2, worker_pb2_grpc

HI, VOCAB = 504, 49152
PROMPT = [HI, 5, 6, 7]


@pytest.fixture(scope="module")
def stubs(cluster_pdc: Any) -> Iterator[dict[str, worker_pb2_grpc.WorkerStub]]:
    addrs = {w.worker_id: w.address for w in cluster_pdc.status().workers}
    chans = {wid: grpc.insecure_channel(a) for wid, a in addrs.items()}
    yield {wid: worker_pb2_grpc.WorkerStub(ch) for wid, ch in chans.items()}
    for ch in chans.values():
        ch.close()


def sampling() -> common_pb2.SamplingParams:
    return common_pb2.SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)


def entries(outputs: Any, rid: str, until: Callable[[list[Any]], bool]) -> list[Any]:
    """A request's entries on an Outputs stream (token 0s, transfers, reservations, tokens,
    in the order they came) until ``until(entries)`` holds."""
    got: list[Any] = []
    for batch in outputs:
        for field in ("token0s", "transfers", "reserved", "tokens"):
            got += [e for e in getattr(batch, field) if e.request_id == rid]
        if until(got):
            return got
    raise AssertionError(f"the Outputs stream ended before {rid} did: {got}")


def subscribe(stub: worker_pb2_grpc.WorkerStub, sid: str) -> Any:
    outs = stub.Outputs(worker_pb2.OutputsRequest(subscriber_id=sid), timeout=120)
    assert next(outs).seq == 0
    return outs


def start(stub: worker_pb2_grpc.WorkerStub, rid: str, sid: str, **kw: Any) -> None:
    req = dict(request_id=rid, prompt_token_ids=PROMPT, seed=1, sampling=sampling(),
               subscriber_id=sid)
    req.update(kw)
    stub.StartPrefill(worker_pb2.PrefillRequest(**req), timeout=30)


def kind(e: Any) -> str:
    return type(e).__name__


def metric(cluster: Any, wid: str, pattern: str) -> float:
    """The sum of a worker's /metrics samples whose line matches ``pattern``."""
    port = cluster.metrics_ports[wid]
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        text = r.read().decode()
    return sum(float(m.group(1)) for m in re.finditer(rf"^{pattern} (\S+)$", text, re.M))


TRANSFERRED = r'pdserve_worker_requests_total\{[^}]*outcome="transferred"[^}]*\}'
TRANSFER_SECONDS = r"pdserve_worker_kv_transfer_seconds_count"


def test_a_started_prefill_hands_its_kv_to_a_consumer_over_the_outputs_streams(
        cluster_pdc: Any, stubs: dict[str, Any]) -> None:
    prod, cons, colo = stubs["worker-0"], stubs["worker-1"], stubs["worker-2"]
    counted = (metric(cluster_pdc, "worker-0", TRANSFERRED),
               metric(cluster_pdc, "worker-0", TRANSFER_SECONDS))
    p_out, c_out = subscribe(prod, "sp-p"), subscribe(cons, "sp-c")
    try:
        cons.StartDecode(worker_pb2.DecodeRequest(
            request_id="sp-1", prompt_token_ids=PROMPT, seed=1, sampling=sampling(),
            subscriber_id="sp-c"), timeout=30)
        [r] = entries(c_out, "sp-1", bool)
        assert kind(r) == "Reserved" and r.block_ids
        start(prod, "sp-1", "sp-p")
        # its token 0, then (once the destination is in) its result, on the one stream
        [t0] = entries(p_out, "sp-1", bool)
        assert kind(t0) == "Token0" and t0.received_ns <= t0.sampled_ns <= t0.sent_ns
        dest = worker_pb2.KVDestination(consumer_id="worker-1", kv_address=r.kv_address,
                                        block_ids=r.block_ids, cached_blocks=r.cached_blocks)
        assert prod.PrefillControl(worker_pb2.PrefillControlRequest(
            request_id="sp-1", queued=worker_pb2.ReservationQueued(consumer_id="worker-1")),
            timeout=10).known
        assert prod.PrefillControl(worker_pb2.PrefillControlRequest(
            request_id="sp-1", destination=dest), timeout=10).known
        [tr] = entries(p_out, "sp-1", bool)
        assert kind(tr) == "TransferResult" and tr.ok and not tr.error, tr
        toks = entries(c_out, "sp-1", lambda g: bool(g) and bool(g[-1].finish_reason))
        decoded = [i for t in toks for i in t.token_ids]
        # the request ended on the producer: a control call now finds nothing
        assert not prod.PrefillControl(worker_pb2.PrefillControlRequest(
            request_id="sp-1", destination=dest), timeout=10).known
    finally:
        p_out.cancel()
        c_out.cancel()
    ref = colo.Decode(worker_pb2.DecodeRequest(
        request_id="sp-ref", prompt_token_ids=PROMPT, seed=1, sampling=sampling(),
        colocated=True), timeout=60)
    want = [i for m in ref if m.WhichOneof("kind") == "tokens" for i in m.tokens.token_ids]
    assert [t0.token_id, *decoded] == want
    # counted as a Prefill stream's would be: its outcome and its transfer's time
    assert (metric(cluster_pdc, "worker-0", TRANSFERRED),
            metric(cluster_pdc, "worker-0", TRANSFER_SECONDS)) == (counted[0] + 1,
                                                                  counted[1] + 1)
    wait_whole(cluster_pdc)


def test_start_prefill_refusals_name_the_field(cluster_pdc: Any, stubs: dict[str, Any]) -> None:
    prod = stubs["worker-0"]
    outs = subscribe(prod, "sp-refusals")
    try:
        for change, code, prefix in [
                (dict(subscriber_id=""), grpc.StatusCode.INVALID_ARGUMENT, "subscriber_id:"),
                (dict(subscriber_id="not-open"), grpc.StatusCode.FAILED_PRECONDITION,
                 "subscriber_id:"),
                (dict(prompt_token_ids=[HI, VOCAB]), grpc.StatusCode.INVALID_ARGUMENT,
                 "prompt_token_ids[1]:"),
                (dict(request_id=""), grpc.StatusCode.INVALID_ARGUMENT, "request_id:")]:
            with pytest.raises(grpc.RpcError) as e:
                start(prod, "sp-refused", "sp-refusals", **change)
            assert e.value.code() == code and (e.value.details() or "").startswith(prefix), (
                change, e.value.code(), e.value.details())
        with pytest.raises(grpc.RpcError) as e:
            prod.PrefillControl(worker_pb2.PrefillControlRequest(request_id="sp-x"),
                                timeout=10)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert (e.value.details() or "").startswith("kind:")
        assert not prod.PrefillControl(worker_pb2.PrefillControlRequest(
            request_id="never-started", queued=worker_pb2.ReservationQueued()),
            timeout=10).known
        # a consumer serves no StartPrefill
        with pytest.raises(grpc.RpcError) as e:
            start(stubs["worker-1"], "sp-on-consumer", "sp-refusals")
        assert e.value.code() == grpc.StatusCode.UNIMPLEMENTED
    finally:
        outs.cancel()
    wait_whole(cluster_pdc)


def test_abort_or_a_lost_outputs_stream_ends_a_started_prefill(
        cluster_pdc: Any, stubs: dict[str, Any]) -> None:
    prod = stubs["worker-0"]
    outs = subscribe(prod, "sp-abort")
    try:
        start(prod, "sp-2", "sp-abort")
        [t0] = entries(outs, "sp-2", bool)
        assert kind(t0) == "Token0"
        with pytest.raises(grpc.RpcError) as e:  # its id is taken while it runs
            start(prod, "sp-2", "sp-abort")
        assert e.value.code() == grpc.StatusCode.ALREADY_EXISTS
        assert prod.Abort(worker_pb2.WorkerAbortRequest(request_id="sp-2"), timeout=10).ok
        [tr] = entries(outs, "sp-2", bool)
        assert kind(tr) == "TransferResult" and not tr.ok and "aborted" in tr.error, tr
    finally:
        outs.cancel()
    # a started request whose router's stream goes away is aborted then, well inside the
    # producer's 30 s lease on its blocks, which would free them otherwise
    lost = subscribe(prod, "sp-lost")
    start(prod, "sp-3", "sp-lost")
    [t0] = entries(lost, "sp-3", bool)
    lost.cancel()
    wait_whole(cluster_pdc, timeout=10.0)
