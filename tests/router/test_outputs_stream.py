"""The router's end of the per-worker Outputs stream (router/requests/worker_outputs.py), against
scripted workers: a request is started with StartDecode and its reservation and tokens
arrive batched and demultiplexed, outputs that overtake StartDecode's answer are not lost,
a worker without Outputs still works on Decode streams, and a broken stream fails over
like a broken Decode stream."""

from __future__ import annotations

import asyncio
from typing import Any

import grpc
from pdserve.v1 import common_pb2, worker_pb2
from router_fakes import (
    CO,
    LENGTH,
    TOKEN0,
    Cluster,
    decode_endless,
    decode_hang_after_reserve,
    prefill_hang_after_token0,
    request,
    reserved,
    run,
    tokens,
    wait_until,
)

from router.requests.worker_outputs import State


def test_tokens_come_batched_and_each_request_gets_its_own() -> None:
    async def main() -> None:
        async with Cluster() as cl:
            _, c = await cl.pd()
            c.outputs = True
            got = await asyncio.gather(*(cl.generate(max_tokens=4) for _ in range(6)))
            for resps in got:
                ids = [i for r in resps for i in r.token_ids]
                assert ids == [TOKEN0, 101, 102, 103], ids
                assert resps[-1].finish_reason == LENGTH
            subs = {r.subscriber_id for r in c.decode_requests}
            assert len(subs) == 1 and "" not in subs  # one stream, named by every request
            assert len(c.decode_requests) == 6

    run(main())


def test_outputs_that_overtake_start_decode_reach_the_run() -> None:
    """StartDecode answers 0.3 s after its request's reservation and tokens went out on the
    Outputs stream: the leg is routed before the call, so every token still arrives."""
    async def main() -> None:
        async with Cluster() as cl:
            p, c = await cl.pd()
            c.outputs, c.start_delay_s = True, 0.3
            resps = await cl.generate(max_tokens=4)
            assert [i for r in resps for i in r.token_ids] == [TOKEN0, 101, 102, 103]
            assert resps[-1].finish_reason == LENGTH and not resps[-1].error, resps[-1]
            assert p.destinations  # the reservation came on the Outputs stream

    run(main())


def test_a_worker_without_outputs_streams_on_decode() -> None:
    async def main() -> None:
        async with Cluster() as cl:
            w = await cl.add("w0", CO)  # outputs=False: answers UNIMPLEMENTED
            resps = await cl.generate(max_tokens=2)
            assert [i for r in resps for i in r.token_ids] == [TOKEN0, 103]
            assert w.decode_requests[0].subscriber_id == ""
            outs = cl.server._channels._outputs["w0"]  # type: ignore[union-attr]
            assert outs.state is State.UNSUPPORTED

    run(main())


def test_a_broken_outputs_stream_migrates_its_requests() -> None:
    async def first_then_hang(w: Any, req: worker_pb2.DecodeRequest) -> Any:
        yield tokens([TOKEN0], "A")
        await asyncio.sleep(3600)

    async def main() -> None:
        async with Cluster(max_migrations=1) as cl:
            a = await cl.add("a", CO, decode=first_then_hang, outputs=True)
            call = cl.router.Generate(request(max_tokens=2))
            first = await call.read()
            assert list(first.token_ids) == [TOKEN0]
            await cl.add("b", CO, outputs=True)
            outs = cl.server._channels._outputs["a"]  # type: ignore[union-attr]
            assert outs.state is State.READY
            outs.close()  # the stream breaks; the Decode stream itself is fine
            rest = []
            while (r := await call.read()) is not grpc.aio.EOF:
                rest.append(r)
            ids = [i for r in [first, *rest] for i in r.token_ids]
            assert ids[0] == TOKEN0 and rest[-1].finish_reason == LENGTH, rest
            assert a.aborts  # the failed leg was aborted on its worker

    run(main())


def test_the_reservation_comes_on_the_outputs_stream() -> None:
    async def main() -> None:
        async with Cluster() as cl:
            p, c = await cl.pd()
            c.outputs = True
            await cl.generate(max_tokens=4)
            assert p.destinations and list(p.destinations[0].block_ids) == list(
                reserved().reserved.block_ids)
            assert c.decode_requests[0].subscriber_id
            assert not c.cancelled and not c.aborts  # finished: nothing to cancel or abort

    run(main())


def test_a_client_that_leaves_aborts_its_started_request() -> None:
    """No per-request call is left to cancel: the worker hears of it through Abort, and the
    leg's route on the Outputs stream goes away."""
    async def main() -> None:
        async with Cluster() as cl:
            p, c = await cl.pd(prefill=prefill_hang_after_token0,
                               decode=decode_hang_after_reserve)
            c.outputs = True
            call = cl.router.Generate(request(request_id="r1"))
            first = await call.read()
            assert list(first.token_ids) == [TOKEN0]
            await wait_until(lambda: len(p.destinations) == 1)
            call.cancel()
            await asyncio.wait_for(c.abort_event.wait(), 5)
            assert c.aborts == ["r1"]
            await wait_until(lambda: c.cancelled == ["r1"])  # the fake's request task
            outs = cl.server._channels._outputs["c0"]  # type: ignore[union-attr]
            await wait_until(lambda: not outs._routes)
            assert outs.state is State.READY  # the stream stays for the next request

    run(main())


def test_a_refused_start_decode_fails_the_request_with_its_status() -> None:
    async def refuse(w: Any, req: worker_pb2.DecodeRequest) -> Any:
        raise AssertionError("never run")
        yield  # an async generator

    async def main() -> None:
        async with Cluster() as cl:
            await cl.add("w0", CO, decode=refuse, outputs=True, refuse_start=(
                grpc.StatusCode.INVALID_ARGUMENT, "sampling.max_tokens: too many"))
            resps = await cl.generate(max_tokens=2)
            last = resps[-1]
            assert last.finish_reason == common_pb2.FINISH_REASON_ERROR
            assert "INVALID_ARGUMENT" in last.error and "sampling.max_tokens" in last.error, last
            outs = cl.server._channels._outputs["w0"]  # type: ignore[union-attr]
            assert not outs._routes

    run(main())


def test_a_leg_cancelled_while_starting_aborts_once_the_worker_answers() -> None:
    """The client leaves while StartDecode is in flight: the worker may take the request
    after an Abort sent at once, so the leg aborts again after the answer."""
    async def main() -> None:
        async with Cluster() as cl:
            w = await cl.add("w0", CO, decode=decode_hang_after_reserve, outputs=True)
            w.start_delay_s = 0.5
            call = cl.router.Generate(request(request_id="r1"))
            await wait_until(lambda: len(w.decode_requests) == 1)
            call.cancel()
            await wait_until(lambda: w.aborts.count("r1") == 2, timeout=5)
            outs = cl.server._channels._outputs["w0"]  # type: ignore[union-attr]
            assert not outs._routes

    run(main())


def test_outputs_of_a_request_whose_abort_was_lost_abort_it_again() -> None:
    """The worker drops the router's Abort (as when it overtook a late StartDecode answer)
    and goes on decoding: the tokens that keep coming for a request no leg routes abort it
    from the Outputs stream, once."""
    async def main() -> None:
        async with Cluster() as cl:
            w = await cl.add("w0", CO, decode=decode_endless, outputs=True)
            w.lose_aborts = 1
            call = cl.router.Generate(request(request_id="r1"))
            await call.read()
            await call.read()  # decoding
            call.cancel()
            await wait_until(lambda: w.cancelled == ["r1"], timeout=5)
            assert w.lost_aborts == ["r1"] and w.aborts == ["r1"]  # the stream's own
            await asyncio.sleep(0.3)
            assert w.aborts == ["r1"]  # once
            outs = cl.server._channels._outputs["w0"]  # type: ignore[union-attr]
            assert outs.state is State.READY and not outs._routes

    run(main())
