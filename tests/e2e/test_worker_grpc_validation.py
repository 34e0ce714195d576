"""A worker's own gRPC door, called directly (no router in the path), refuses every malformed
Prefill/Decode with INVALID_ARGUMENT naming the field, counts it in its /metrics, and keeps
serving; a hypothesis-generated stream of well-formed protos with random field values never
kills or wedges it, and leaves its KV pool whole."""

from __future__ import annotations

import itertools
import re
import urllib.request
from collections.abc import Iterator
from typing import Any

import grpc
import pytest
from cluster_client import wait_whole
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pdserve.v1 import common_pb2, router_pb2, worker_pb2, worker_pb2_grpc

VOCAB = 49152  # SmolLM2
HI = 504  # some ordinary token id


def workers(cluster: Any) -> dict[str, str]:
    return {w.worker_id: w.address for w in cluster.status().workers}


@pytest.fixture(scope="module")
def stubs(cluster_pdc: Any) -> Iterator[dict[str, worker_pb2_grpc.WorkerStub]]:
    chans = {wid: grpc.insecure_channel(addr) for wid, addr in workers(cluster_pdc).items()}
    yield {wid: worker_pb2_grpc.WorkerStub(ch) for wid, ch in chans.items()}
    for ch in chans.values():
        ch.close()


def invalid_count(cluster: Any, wid: str) -> float:
    port = cluster.metrics_ports[wid]
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        text = r.read().decode()
    return sum(float(m.group(1)) for m in re.finditer(
        r'^pdserve_worker_requests_total\{[^}]*outcome="invalid"[^}]*\} (\S+)$', text, re.M))


def sp(**kw: Any) -> common_pb2.SamplingParams:
    return common_pb2.SamplingParams(**kw)


def decode(stub: worker_pb2_grpc.WorkerStub, rid: str, ids: list[int],
           s: common_pb2.SamplingParams, colocated: bool, seed: int = 1,
           cancel_after_first: bool = False) -> tuple[grpc.StatusCode, str, list[int], int]:
    """(code, details, token ids, finish reason) of one Decode call."""
    call = stub.Decode(worker_pb2.DecodeRequest(request_id=rid, prompt_token_ids=ids,
                                                sampling=s, seed=seed, colocated=colocated),
                       timeout=60)
    toks: list[int] = []
    finish = 0
    try:
        for msg in call:
            if msg.WhichOneof("kind") == "tokens":
                toks += msg.tokens.token_ids
                finish = msg.tokens.finish_reason or finish
            if cancel_after_first:
                call.cancel()
                return grpc.StatusCode.OK, "", toks, finish
    except grpc.RpcError as e:
        return e.code(), e.details() or "", toks, finish
    return grpc.StatusCode.OK, "", toks, finish


def prefill(stub: worker_pb2_grpc.WorkerStub, rid: str, ids: list[int],
            s: common_pb2.SamplingParams, seed: int = 1) -> tuple[grpc.StatusCode, str]:
    """Sends a Prefill and hangs up after token 0 (no consumer: the producer must free)."""
    req = worker_pb2.PrefillInput(request=worker_pb2.PrefillRequest(
        request_id=rid, prompt_token_ids=ids, sampling=s, seed=seed))
    call = stub.Prefill(iter([req]), timeout=60)
    try:
        for msg in call:
            assert msg.WhichOneof("kind") == "token0"
            call.cancel()
            break
    except grpc.RpcError as e:
        if e.code() != grpc.StatusCode.CANCELLED:
            return e.code(), e.details() or ""
    return grpc.StatusCode.OK, ""


BAD_DECODES = [
    # the reported crash: stop ids past the vocabulary with min_tokens > 0
    ([HI, 5], sp(max_tokens=4, min_tokens=2, stop_token_ids=[VOCAB + 7]),
     "sampling.stop_token_ids[0]:"),
    ([HI, VOCAB], sp(max_tokens=4), "prompt_token_ids[1]:"),
    ([], sp(max_tokens=4), "prompt_token_ids:"),
    ([HI], sp(max_tokens=4, logprobs=99), "sampling.logprobs:"),
    ([HI], sp(max_tokens=4, min_tokens=9), "sampling.min_tokens:"),
    ([HI], sp(max_tokens=10**6), "sampling.max_tokens:"),
    ([HI], sp(max_tokens=4, top_p=1.0000001), "sampling.top_p:"),
    ([HI], sp(max_tokens=4, temperature=float("nan")), "sampling.temperature:"),
    ([HI], sp(max_tokens=4, stop=[""]), "sampling.stop:"),
]


@pytest.mark.parametrize("wid,colocated", [("worker-2", True), ("worker-1", False)])
def test_malformed_decode_is_invalid_argument_counted_and_worker_keeps_serving(
        cluster_pdc: Any, stubs: dict[str, Any], wid: str, colocated: bool) -> None:
    stub = stubs[wid]
    before = invalid_count(cluster_pdc, wid)
    for i, (ids, s, field) in enumerate(BAD_DECODES):
        code, details, _, _ = decode(stub, f"bad-{wid}-{i}", ids, s, colocated)
        assert code == grpc.StatusCode.INVALID_ARGUMENT, (field, code, details)
        assert details.startswith(field), (field, details)
    code, details, _, _ = decode(stub, "x" * 300, [HI], sp(max_tokens=2), colocated)
    assert code == grpc.StatusCode.INVALID_ARGUMENT and details.startswith("request_id:")
    code, details, _, _ = decode(stub, f"seed-{wid}", [HI], sp(max_tokens=2), colocated,
                                 seed=2**63)
    assert code == grpc.StatusCode.INVALID_ARGUMENT and details.startswith("seed:"), details
    with pytest.raises(grpc.RpcError) as e:
        stub.Abort(worker_pb2.WorkerAbortRequest(request_id="y" * 300), timeout=10)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert (e.value.details() or "").startswith("request_id:")
    assert invalid_count(cluster_pdc, wid) - before == len(BAD_DECODES) + 3
    if colocated:  # a good request after: the engine is alive and serving
        code, details, toks, finish = decode(stub, f"good-{wid}", [HI, 5, 6],
                                             sp(max_tokens=3, temperature=0, ignore_eos=True,
                                                min_tokens=2), True)
        assert code == grpc.StatusCode.OK, details
        assert len(toks) == 3 and finish == common_pb2.FINISH_REASON_LENGTH
    else:  # a reservation after: answered with blocks, then freed when we hang up
        code, details, _, _ = decode(stub, f"good-{wid}", [HI, 5, 6], sp(max_tokens=3), False,
                                     cancel_after_first=True)
        assert code == grpc.StatusCode.OK, details
    wait_whole(cluster_pdc)


def _entries(outputs: Any, rid: str, until: Any) -> list[Any]:
    """Reads an Outputs stream's batches until ``until(entries of rid)`` holds."""
    got: list[Any] = []
    for batch in outputs:
        got += [r for r in batch.reserved if r.request_id == rid]
        got += [t for t in batch.tokens if t.request_id == rid]
        if until(got):
            return got
    raise AssertionError(f"the Outputs stream ended before {rid} did: {got}")


def test_start_decode_takes_a_request_and_its_outputs_ride_the_outputs_stream(
        cluster_pdc: Any, stubs: dict[str, Any]) -> None:
    """StartDecode answers at once; the reservation, tokens and end come on the Outputs
    stream it names; refusals are the call's status; Abort ends a started request."""
    colo, cons = stubs["worker-2"], stubs["worker-1"]
    outs = {wid: stubs[wid].Outputs(worker_pb2.OutputsRequest(subscriber_id=f"t-{wid}"),
                                    timeout=120) for wid in ("worker-2", "worker-1")}
    try:
        for o in outs.values():
            assert next(o).seq == 0  # subscribed
        req = worker_pb2.DecodeRequest(
            request_id="started-1", prompt_token_ids=[HI, 5, 6], colocated=True, seed=1,
            sampling=sp(max_tokens=3, temperature=0, ignore_eos=True),
            subscriber_id="t-worker-2")
        colo.StartDecode(req, timeout=30)
        got = _entries(outs["worker-2"], "started-1", lambda g: g and g[-1].finish_reason)
        assert [i for t in got for i in t.token_ids] and sum(len(t.token_ids) for t in got) == 3
        assert got[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH
        # the same tokens as one Decode stream gives (same seed, greedy)
        _, _, toks, _ = decode(colo, "started-ref", [HI, 5, 6],
                               sp(max_tokens=3, temperature=0, ignore_eos=True), True)
        assert [i for t in got for i in t.token_ids] == toks
        refusals = [
            (dict(subscriber_id=""), grpc.StatusCode.INVALID_ARGUMENT, "subscriber_id:"),
            (dict(prompt_token_ids=[HI, VOCAB]), grpc.StatusCode.INVALID_ARGUMENT,
             "prompt_token_ids[1]:"),
        ]
        for change, code, prefix in refusals:
            bad = worker_pb2.DecodeRequest()
            bad.CopyFrom(req)
            bad.request_id = f"refused-{prefix}"
            for k, v in change.items():
                if isinstance(v, list):
                    del getattr(bad, k)[:]
                    getattr(bad, k).extend(v)
                else:
                    setattr(bad, k, v)
            with pytest.raises(grpc.RpcError) as e:
                colo.StartDecode(bad, timeout=30)
            assert e.value.code() == code and (e.value.details() or "").startswith(prefix), (
                e.value.code(), e.value.details())
        # a consumer: its reservation arrives on the stream; Abort frees it and ends it
        cons.StartDecode(worker_pb2.DecodeRequest(
            request_id="started-2", prompt_token_ids=[HI, 5, 6], seed=1,
            sampling=sp(max_tokens=3), subscriber_id="t-worker-1"), timeout=30)
        [r] = _entries(outs["worker-1"], "started-2", bool)
        assert r.block_ids and r.kv_address
        with pytest.raises(grpc.RpcError) as e:  # its id is taken while it runs
            cons.StartDecode(worker_pb2.DecodeRequest(
                request_id="started-2", prompt_token_ids=[HI], sampling=sp(max_tokens=3),
                subscriber_id="t-worker-1"), timeout=30)
        assert e.value.code() == grpc.StatusCode.ALREADY_EXISTS
        assert cons.Abort(worker_pb2.WorkerAbortRequest(request_id="started-2"), timeout=10).ok
        [end] = _entries(outs["worker-1"], "started-2", bool)
        assert end.finish_reason == common_pb2.FINISH_REASON_ABORT
    finally:
        for o in outs.values():
            o.cancel()
    wait_whole(cluster_pdc)


def test_a_prefill_naming_an_outputs_stream_sends_token0_there(
        cluster_pdc: Any, stubs: dict[str, Any]) -> None:
    """A Prefill with subscriber_id gets its token 0 on that Outputs stream (named, with its
    stamps) and not on its own stream; one naming no open stream is refused by name."""
    stub = stubs["worker-0"]
    outs = stub.Outputs(worker_pb2.OutputsRequest(subscriber_id="t-producer"), timeout=120)
    try:
        assert next(outs).seq == 0  # subscribed
        req = worker_pb2.PrefillInput(request=worker_pb2.PrefillRequest(
            request_id="p-outputs", prompt_token_ids=[HI, 5, 6], seed=1,
            sampling=sp(max_tokens=3, temperature=0), subscriber_id="t-producer"))
        call = stub.Prefill(iter([req]), timeout=60)
        t0 = None
        for batch in outs:
            got = [e for e in batch.token0s if e.request_id == "p-outputs"]
            if got:
                t0 = got[0]
                break
        assert t0 is not None and t0.sampled_ns <= t0.sent_ns and t0.received_ns
        # the same token 0 as a Prefill stream gives (same seed, greedy)
        ref = stub.Prefill(iter([worker_pb2.PrefillInput(request=worker_pb2.PrefillRequest(
            request_id="p-stream", prompt_token_ids=[HI, 5, 6], seed=1,
            sampling=sp(max_tokens=3, temperature=0)))]), timeout=60)
        first = next(ref)
        ref.cancel()
        assert first.WhichOneof("kind") == "token0"
        assert first.token0.token_id == t0.token_id
        call.cancel()  # no consumer: hanging up frees its blocks
        with pytest.raises(grpc.RpcError) as e:
            bad = worker_pb2.PrefillInput()
            bad.CopyFrom(req)
            bad.request.request_id = "p-nowhere"
            bad.request.subscriber_id = "not-open"
            next(stub.Prefill(iter([bad]), timeout=30))
        assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert (e.value.details() or "").startswith("subscriber_id:")
    finally:
        outs.cancel()
    wait_whole(cluster_pdc)


def test_malformed_prefill_is_invalid_argument_counted_and_worker_keeps_serving(
        cluster_pdc: Any, stubs: dict[str, Any]) -> None:
    stub = stubs["worker-0"]
    before = invalid_count(cluster_pdc, "worker-0")
    for i, (ids, s, field) in enumerate(BAD_DECODES):
        code, details = prefill(stub, f"bad-p-{i}", ids, s)
        assert code == grpc.StatusCode.INVALID_ARGUMENT, (field, code, details)
        assert details.startswith(field), (field, details)
    assert invalid_count(cluster_pdc, "worker-0") - before == len(BAD_DECODES)
    assert prefill(stub, "good-p", [HI, 5, 6], sp(max_tokens=3, temperature=0)) == (
        grpc.StatusCode.OK, "")
    wait_whole(cluster_pdc)


ids_st = st.lists(st.one_of(st.integers(0, VOCAB - 1), st.integers(0, 2**32 - 1)),
                  min_size=0, max_size=40)
f32s = st.floats(width=32, allow_nan=True, allow_infinity=True)
sampling_st = st.builds(
    common_pb2.SamplingParams,
    # short, or past any max_model_len: a valid max_tokens in between is a long generation
    # (1226 tokens of SmolLM2 on a busy 2-core CI machine outlasted the call's 60 s), which
    # is load, not hostile input
    max_tokens=st.integers(0, 6) | st.integers(1 << 20, 2**32 - 1), min_tokens=st.integers(0, 8),
    temperature=f32s | st.just(0.0), top_p=f32s | st.just(1.0), top_k=st.integers(-3, 10**6),
    min_p=f32s | st.just(0.0), repetition_penalty=f32s | st.just(1.0),
    frequency_penalty=f32s, presence_penalty=f32s,
    stop=st.lists(st.text(max_size=4), max_size=20),
    stop_token_ids=st.lists(st.integers(0, VOCAB - 1) | st.integers(0, 2**32 - 1), max_size=5),
    ignore_eos=st.booleans(), logprobs=st.integers(0, 40),
    skip_special_tokens=st.booleans(), include_stop_str_in_output=st.booleans())
ALLOWED = {grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT}
_ids = itertools.count()


@settings(max_examples=40, deadline=None, derandomize=False,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(ids=ids_st, s=sampling_st, seed=st.integers(0, 2**64 - 1))
def test_fuzzed_worker_calls_never_hurt_a_worker(cluster_pdc: Any, stubs: dict[str, Any],
                                                 ids: list[int], s: Any, seed: int) -> None:
    rid = f"fuzz-{next(_ids)}"
    code, details, _, _ = decode(stubs["worker-2"], rid, ids, s, True, seed)
    assert code in ALLOWED, (code, details)
    code, details, _, _ = decode(stubs["worker-1"], rid, ids, s, False, seed,
                                 cancel_after_first=True)
    assert code in ALLOWED, (code, details)
    code, details = prefill(stubs["worker-0"], rid, ids, s, seed)
    assert code in ALLOWED, (code, details)


def test_after_the_fuzz_every_worker_serves_and_every_pool_is_whole(cluster_pdc: Any) -> None:
    wait_whole(cluster_pdc)
    from cluster_client import chat, generate, stub_for

    ch, s = stub_for(cluster_pdc.router_address)
    try:
        for _ in range(2):  # round robin: P/D and colocated both answer
            r = generate(s, dict(max_tokens=3, temperature=0), **chat("Hello there"))
            assert r.code is None and len(r.token_ids) == 3, (r.code, r.details)
        assert len(s.ClusterStatus(router_pb2.ClusterStatusRequest()).workers) == 3
    finally:
        ch.close()
