"""Request lifecycle on a live 1P1D cluster: token 0 ending the request at the producer,
aborts in every state, bad requests, and token 0 not held behind other prompts' chunks."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from cluster_client import chat, generate, stub_for, wait_for_full_kv
from pdserve.v1 import common_pb2, router_pb2

Q = "What is the capital of France?"
FIRST_TOKEN = 504  # SmolLM2's greedy token 0 for Q ("The")
LONG = ("Disaggregated serving splits prefill from decode so each can scale on its own. " * 40)


@pytest.fixture
def stub(cluster_1p1d):  # type: ignore[no-untyped-def]
    ch, s = stub_for(cluster_1p1d.router_address)
    yield s
    wait_for_full_kv(s)  # every test leaves both workers' KV pools whole
    ch.close()


def test_token0_stop_token_finishes_at_the_producer(stub):
    r = generate(stub, dict(max_tokens=30, temperature=0, stop_token_ids=[FIRST_TOKEN]), **chat(Q))
    assert r.token_ids == [FIRST_TOKEN] and r.finish_reason == common_pb2.FINISH_REASON_STOP
    assert r.timing.producer and r.timing.consumer_first_step_ns == 0  # no decode step ran
    assert r.usage.completion_tokens == 1


def test_max_tokens_one_finishes_at_the_producer(stub):
    r = generate(stub, dict(max_tokens=1, temperature=0), **chat(Q))
    assert r.token_ids == [FIRST_TOKEN] and r.finish_reason == common_pb2.FINISH_REASON_LENGTH
    assert r.timing.consumer_first_step_ns == 0


def _cancel_after(stub, delay: float, sampling: dict, **inp) -> object:  # type: ignore[no-untyped-def]
    """Starts a Generate call and cancels it after `delay` seconds, whatever it is doing."""
    req = router_pb2.GenerateRequest(sampling=common_pb2.SamplingParams(**sampling), **inp)
    call = stub.Generate(req, timeout=120)
    threading.Timer(delay, call.cancel).start()
    got = []
    try:
        for msg in call:
            got.append(msg)
    except grpc.RpcError as e:
        assert e.code() == grpc.StatusCode.CANCELLED
    return got


@pytest.mark.parametrize("delay", [0.05, 0.4, 1.5], ids=["queued", "prefilling", "decoding"])
def test_client_cancel_frees_blocks_on_both_sides(stub, delay):
    got = _cancel_after(stub, delay, dict(max_tokens=400, temperature=0, ignore_eos=True),
                        **chat(LONG))
    assert not any(m.finish_reason for m in got)  # it really was cut off
    wait_for_full_kv(stub)
    r = generate(stub, dict(max_tokens=4, temperature=0), **chat(Q))  # still serving
    assert r.token_ids[0] == FIRST_TOKEN


def test_cancel_right_after_token0_while_kv_moves(stub):
    # Cancelling on token 0 lands while the KV is transferring or the consumer admits it.
    r = generate(stub, dict(max_tokens=300, temperature=0, ignore_eos=True), cancel_after=1,
                 **chat(LONG))
    assert r.token_ids and r.messages == 1
    wait_for_full_kv(stub)


def test_router_abort_by_id_mid_decode(stub):
    out = {}

    def run() -> None:
        out["r"] = generate(stub, dict(max_tokens=400, temperature=0, ignore_eos=True),
                            request_id="to-abort", **chat(Q))

    t = threading.Thread(target=run)
    t.start()
    deadline = time.monotonic() + 60
    while True:  # abort as soon as the router knows the request
        if stub.Abort(router_pb2.AbortRequest(request_id="to-abort")).ok:
            break
        assert time.monotonic() < deadline
        time.sleep(0.05)
    t.join(60)
    r = out["r"]
    assert r.finish_reason == common_pb2.FINISH_REASON_ABORT or r.code is not None
    assert len(r.token_ids) < 400


@pytest.mark.parametrize("sampling,inp,field", [
    (dict(max_tokens=8), {"prompt": ""}, "prompt"),
    (dict(max_tokens=8), {"prompt": "hi " * 9000}, "prompt"),
    (dict(max_tokens=8, top_p=0.0), {"prompt": "hi"}, "top_p"),
    (dict(max_tokens=8, temperature=-1.0), {"prompt": "hi"}, "temperature"),
    (dict(max_tokens=0), {"prompt": "hi"}, "max_tokens"),
    (dict(max_tokens=10**9), {"prompt": "hi"}, "max_tokens"),
])
def test_bad_requests_get_invalid_argument(stub, sampling, inp, field):
    r = generate(stub, sampling, **inp)
    assert r.code == grpc.StatusCode.INVALID_ARGUMENT and field in r.details, r.details


def test_unknown_model_is_invalid_argument(stub):
    req = router_pb2.GenerateRequest(model="no-such-model", prompt="hi",
                                     sampling=common_pb2.SamplingParams(max_tokens=2))
    with pytest.raises(grpc.RpcError) as e:
        list(stub.Generate(req, timeout=30))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "model" in e.value.details()
    assert generate(stub, dict(max_tokens=2, temperature=0), **chat(Q)).token_ids  # serving


def test_short_token0_not_held_behind_long_prefills(stub):
    # The short request is scheduled with the first chunk of the long ones; after its
    # sampling step the producer runs only middle chunks of the long prompts for a while.
    long_req = dict(max_tokens=2, temperature=0)
    with ThreadPoolExecutor(3) as pool:
        short = pool.submit(generate, stub, dict(max_tokens=2, temperature=0), **chat(Q))
        time.sleep(0.02)
        longs = [pool.submit(generate, stub, long_req, **chat(LONG + str(i))) for i in range(2)]
        s, ls = short.result(), [f.result() for f in longs]
    # The producer's own hold (sampling forward to its stream), not the router's forward,
    # which a loaded machine can delay: a deferring producer would hold it a whole forward.
    hold_ms = (s.timing.producer_token0_sent_ns - s.timing.producer_token0_sampled_ns) / 1e6
    assert 0 < hold_ms < 50, hold_ms
    assert s.timing.producer_token0_sent_ns <= s.timing.router_token0_sent_ns
    # The long prompts were still prefilling (many chunks) after the short token 0 was out.
    for lr in ls:
        assert lr.timing.producer_token0_sampled_ns > s.timing.producer_token0_sent_ns
