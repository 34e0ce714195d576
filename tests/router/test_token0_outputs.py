"""A producer's token 0 on the router's Outputs stream with a Prefill stream beside it (a
producer without StartPrefill; router/requests/producer_leg.py), against scripted workers:
the Prefill names the stream and token 0 comes from there; the transfer result and the
Prefill stream's end, which are not ordered with that stream, reach the run only after token
0; a stream that breaks before token 0 sends the request to another producer; a producer
without the stream sends token 0 on the Prefill stream."""

from __future__ import annotations

import asyncio
from typing import Any

from pdserve.v1 import worker_pb2
from router_fakes import LENGTH, STOP, TOKEN0, Cluster, run, token0, wait_until

P, C = 1, 2


def test_token0_comes_on_the_producers_outputs_stream() -> None:
    async def main() -> None:
        async with Cluster() as cl:
            p = await cl.add("p0", P, outputs=True, start_prefill=False)
            await cl.add("c0", C, outputs=True)
            got = await asyncio.gather(*(cl.generate(max_tokens=4) for _ in range(4)))
            for resps in got:
                assert [list(r.token_ids) for r in resps] == [[TOKEN0], [101, 102], [103]]
                assert resps[-1].finish_reason == LENGTH and not resps[-1].error
                t = resps[-1].timing
                assert 0 < t.producer_token0_sampled_ns <= t.router_token0_sent_ns
                # read off the Outputs stream before it was sent on
                assert 0 < t.router_token0_read_ns <= t.router_token0_sent_ns
            subs = {r.subscriber_id for r in p.prefill_requests}
            assert len(subs) == 1 and "" not in subs  # one stream, named by every request

    run(main())


def test_a_transfer_result_that_overtakes_token0_waits_for_it() -> None:
    """Token 0 reaches the Outputs stream 0.3 s late: the transfer result and the consumer's
    tokens are there first, and the client still gets token 0 first, then the rest."""
    async def main() -> None:
        async with Cluster() as cl:
            p = await cl.add("p0", P, outputs=True, start_prefill=False, token0_delay_s=0.3)
            await cl.add("c0", C, outputs=True)
            resps = await cl.generate(request_id="r1", max_tokens=4)
            assert [list(r.token_ids) for r in resps] == [[TOKEN0], [101, 102], [103]]
            assert resps[-1].finish_reason == LENGTH and not resps[-1].error, resps[-1]
            assert p.destinations and p.prefill_requests[0].subscriber_id

    run(main())


def test_an_outputs_stream_broken_before_token0_sends_the_request_elsewhere() -> None:
    async def main() -> None:
        async with Cluster() as cl:
            p0 = await cl.add("p0", P, outputs=True, start_prefill=False, token0_delay_s=3600)
            await cl.add("c0", C, outputs=True)
            task = asyncio.get_running_loop().create_task(
                cl.generate(request_id="r1", max_tokens=4))
            await wait_until(lambda: bool(p0.destinations))  # token 0 still to come
            p1 = await cl.add("p1", P, outputs=True, start_prefill=False)
            p0.break_outputs()
            resps = await task
            assert [list(r.token_ids) for r in resps] == [[TOKEN0], [101, 102], [103]]
            assert resps[-1].finish_reason == LENGTH and not resps[-1].error, resps[-1]
            assert resps[-1].timing.producer == "p1"
            assert [r.request_id for r in p1.prefill_requests] == ["r1#retry1"]

    run(main())


def test_a_producer_without_outputs_sends_token0_on_the_prefill_stream() -> None:
    async def main() -> None:
        async with Cluster() as cl:
            p = await cl.add("p0", P)  # outputs=False: its Outputs answers UNIMPLEMENTED
            await cl.add("c0", C, outputs=True)
            resps = await cl.generate(max_tokens=4)
            assert [list(r.token_ids) for r in resps] == [[TOKEN0], [101, 102], [103]]
            assert p.prefill_requests[0].subscriber_id == ""

    run(main())


async def prefill_busy(w: Any, req: Any, inputs: Any) -> Any:
    """Refused before the prefill (its engine queue is full): no token 0 ever comes."""
    yield worker_pb2.PrefillOutput(transfer=worker_pb2.TransferResult(
        ok=False, busy=True, error="producer busy: waiting queue is full (1 requests)"))


def test_a_refusal_before_token0_waits_for_no_token() -> None:
    """A busy producer's result names no routed token 0: the run takes it at once and sends
    the request to the other producer (a live cluster showed it: waiting for a token 0 that
    never comes hung the request until its deadline)."""
    async def main() -> None:
        async with Cluster() as cl:
            p0 = await cl.add("p0", P, outputs=True, start_prefill=False, prefill=prefill_busy)
            p1 = await cl.add("p1", P, outputs=True, start_prefill=False)
            await cl.add("c0", C, outputs=True)
            resps = await asyncio.wait_for(cl.generate(request_id="r1", max_tokens=4), 5)
            assert [list(r.token_ids) for r in resps] == [[TOKEN0], [101, 102], [103]]
            assert resps[-1].timing.producer == "p1" and not resps[-1].error
            assert p0.prefill_requests[0].subscriber_id  # it was named: the wait was possible
            assert [r.request_id for r in p1.prefill_requests] == ["r1#retry1"]

    run(main())


async def prefill_stop_at_token0(w: Any, req: Any, inputs: Any) -> Any:
    yield token0(finish=STOP, stop_reason="eos")


def test_a_token0_that_ends_the_request_comes_on_the_prefill_stream() -> None:
    async def main() -> None:
        async with Cluster() as cl:
            p = await cl.add("p0", P, outputs=True, start_prefill=False,
                             prefill=prefill_stop_at_token0)
            await cl.add("c0", C, outputs=True)
            resps = await asyncio.wait_for(cl.generate(max_tokens=4), 5)
            assert [list(r.token_ids) for r in resps] == [[TOKEN0]]
            assert resps[-1].finish_reason == STOP
            assert p.prefill_requests[0].subscriber_id

    run(main())
