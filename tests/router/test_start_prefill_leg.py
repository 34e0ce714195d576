"""The producer leg with StartPrefill (router/requests/producer_leg.py), against scripted
workers that serve it: the request starts with one unary call and holds no stream; token 0
and the transfer's result come on the producer's Outputs stream, the destination and the
lease renewals go in with PrefillControl; a refusal, a busy producer or a stream that breaks
before the result sends the request on as a Prefill stream's failure would; a client that
leaves gets the request aborted on the producer, also while StartPrefill is in flight."""

from __future__ import annotations

import asyncio
from typing import Any

import grpc
from router_fakes import (
    LENGTH,
    STOP,
    TOKEN0,
    C,
    Cluster,
    FakeWorker,
    P,
    decode_endless,
    prefill_hang_after_token0,
    read_all,
    request,
    reserved,
    run,
    token0,
    tokens,
    transfer,
    wait_until,
)

from router.requests.worker_outputs import WorkerOutputs

WANT = [[TOKEN0], [101, 102], [103]]


def test_a_started_prefill_comes_back_on_the_outputs_stream_with_no_stream_of_its_own(
        ) -> None:
    async def main() -> None:
        async with Cluster() as cl:
            p = await cl.add("p0", P, outputs=True)
            await cl.add("c0", C, outputs=True)
            got = await asyncio.gather(*(cl.generate(max_tokens=4) for _ in range(4)))
            for resps in got:
                assert [list(r.token_ids) for r in resps] == WANT
                assert resps[-1].finish_reason == LENGTH and not resps[-1].error
                t = resps[-1].timing
                assert t.kv_transfer_ms == 1.5  # the result reached the run
                # stamped as its PrefillControl call went out
                assert 0 < t.router_received_ns < t.router_destination_sent_ns
            await wait_until(lambda: len(p.destinations) == 4)  # the last may trail its end
            assert len(p.prefill_requests) == 4
            assert {r.subscriber_id for r in p.prefill_requests} != {""}
            # every request came with StartPrefill (the fake records no Prefill stream there)
            assert set(p.started) == {r.request_id for r in p.prefill_requests}
            assert not p.cancelled

    run(main())


def test_holds_go_in_with_prefill_control_while_the_reservation_waits() -> None:
    async def decode(w: FakeWorker, req: Any) -> Any:
        await asyncio.sleep(0.6)  # the reservation waits for blocks
        yield reserved()
        yield tokens([101, 102], "BC", kv_ready_ns=1, first_step_ns=1)
        yield tokens([103], "D", LENGTH)

    async def main() -> None:
        async with Cluster(hold_interval_s=0.1) as cl:
            p = await cl.add("p0", P, outputs=True)
            await cl.add("c0", C, outputs=True, decode=decode)
            resps = await cl.generate(max_tokens=4)
            assert [list(r.token_ids) for r in resps] == WANT
            await wait_until(lambda: len(p.destinations) == 1)
            assert p.holds
            assert {c for _, c in p.holds} == {"c0"}
            n = len(p.holds)
            await asyncio.sleep(0.4)
            assert len(p.holds) == n  # none after the destination

    run(main())


def _busy(out: Any) -> Any:
    out.transfer.busy = True
    return out


async def prefill_refused_busy(w: FakeWorker, req: Any, inputs: Any) -> Any:
    yield _busy(transfer(ok=False, error="producer busy: waiting queue is full"))


def test_a_busy_result_or_a_refused_start_sends_the_request_to_another_producer() -> None:
    async def main() -> None:
        for refuse in (None, (grpc.StatusCode.RESOURCE_EXHAUSTED, "the engine is behind")):
            async with Cluster() as cl:
                p0 = await cl.add("p0", P, outputs=True, prefill=prefill_refused_busy,
                                  refuse_start=refuse)
                p1 = await cl.add("p1", P, outputs=True)
                await cl.add("c0", C, outputs=True)
                resps = await asyncio.wait_for(cl.generate(request_id="r1", max_tokens=4), 5)
                assert [list(r.token_ids) for r in resps] == WANT, refuse
                assert resps[-1].timing.producer == "p1" and not resps[-1].error
                assert len(p0.prefill_requests) == 1
                assert [r.request_id for r in p1.prefill_requests] == ["r1#retry1"]

    run(main())


async def prefill_stop_at_token0(w: FakeWorker, req: Any, inputs: Any) -> Any:
    yield token0(finish=STOP, stop_reason="eos")


def test_a_token0_that_ends_the_request_is_its_last_entry() -> None:
    async def main() -> None:
        async with Cluster() as cl:
            p = await cl.add("p0", P, outputs=True, prefill=prefill_stop_at_token0)
            await cl.add("c0", C, outputs=True)
            resps = await asyncio.wait_for(cl.generate(max_tokens=4), 5)
            assert [list(r.token_ids) for r in resps] == [[TOKEN0]]
            assert resps[-1].finish_reason == STOP and not resps[-1].error
            assert p.prefill_requests[0].subscriber_id and not p.aborts

    run(main())


def test_an_outputs_stream_broken_before_the_result_fails_the_producer_leg() -> None:
    """Token 0 came and the destination went in, then the producer's stream broke before its
    result: the leg fails, and the run migrates the request as for a dead producer (its
    client has token 0): another producer prefills it with token 0 as a prior output."""
    async def decode(w: FakeWorker, req: Any) -> Any:
        yield reserved()
        await asyncio.sleep(0.5)  # the KV is on its way when the producer's stream breaks
        yield tokens([101, 102], "BC", kv_ready_ns=1, first_step_ns=1)
        yield tokens([103], "D", LENGTH)

    async def main() -> None:
        async with Cluster() as cl:
            p0 = await cl.add("p0", P, outputs=True, prefill=prefill_hang_after_token0)
            await cl.add("c0", C, outputs=True, decode=decode)
            call = cl.router.Generate(request(request_id="r1", max_tokens=4))
            first = await call.read()
            assert list(first.token_ids) == [TOKEN0]
            await wait_until(lambda: bool(p0.destinations))
            p1 = await cl.add("p1", P, outputs=True)
            p0.break_outputs()
            rest = await read_all(call)
            assert rest[-1].finish_reason == LENGTH and not rest[-1].error, rest[-1]
            [moved] = p1.prefill_requests
            assert list(moved.prior_output_ids) == [TOKEN0] and moved.subscriber_id

    run(main())


def test_a_client_that_leaves_aborts_the_started_prefill() -> None:
    async def prefill(w: FakeWorker, req: Any, inputs: Any) -> Any:
        await asyncio.sleep(3600)  # still prefilling when the client goes
        yield token0()

    async def leave(cl: Cluster, delay: float) -> None:
        p = await cl.add("p0", P, outputs=True, prefill=prefill, start_delay_s=delay)
        await cl.add("c0", C, outputs=True, decode=decode_endless)
        call = cl.router.Generate(request(request_id="r1", max_tokens=4))
        await wait_until(lambda: bool(p.prefill_requests))
        call.cancel()
        await asyncio.wait_for(p.abort_event.wait(), 5)
        await wait_until(lambda: "r1" in p.cancelled)  # its work ended there
        assert "r1" in p.aborts

    async def main() -> None:
        for delay in (0.0, 0.3):  # 0.3: the client leaves while StartPrefill is in flight
            async with Cluster() as cl:
                await leave(cl, delay)

    run(main())


def test_a_producer_without_start_prefill_is_remembered_and_served_on_prefill_streams(
        ) -> None:
    async def main() -> None:
        async with Cluster() as cl:
            p = await cl.add("p0", P, outputs=True, start_prefill=False)
            await cl.add("c0", C, outputs=True)
            for _ in range(3):
                resps = await cl.generate(max_tokens=4)
                assert [list(r.token_ids) for r in resps] == WANT
            assert len(p.prefill_requests) == 3 and not p.started  # each on a Prefill stream
            assert cl.server.dispatcher is not None
            outs = cl.server.dispatcher.channels._outputs["p0"]
            assert isinstance(outs, WorkerOutputs) and not outs.start_prefill

    run(main())
