"""Aborts fan out to every leg on every way a request can end before its legs finished
(router/requests/request_run.py, "Teardown"): both workers get Worker.Abort and their
streams end."""

from __future__ import annotations

import asyncio
from typing import Any

import grpc
import pytest
from pdserve.v1 import router_pb2
from router_fakes import (
    ABORT,
    ERROR,
    LENGTH,
    TOKEN0,
    Cluster,
    decode_hang_after_reserve,
    prefill_hang_after_token0,
    read_all,
    request,
    reserved,
    run,
    tokens,
    wait_until,
)


async def _client_cancel(cl: Cluster, call: Any) -> None:
    call.cancel()


async def _router_abort(cl: Cluster, call: Any) -> None:
    assert (await cl.router.Abort(router_pb2.AbortRequest(request_id="r1"))).ok


async def _consumer_dropped(cl: Cluster, call: Any) -> None:
    cl.workers[1].heartbeating = False  # wedged: the registry drops it


async def _router_shutdown(cl: Cluster, call: Any) -> None:
    await cl.server.stop(grace=0.5)


@pytest.mark.parametrize("end,finish", [
    (_client_cancel, None), (_router_abort, ABORT), (_consumer_dropped, ERROR),
    (_router_shutdown, ERROR), (None, ERROR),  # None: a timeout
], ids=["client-cancel", "router-abort", "consumer-dropped", "router-shutdown", "timeout"])
def test_every_early_end_aborts_both_legs(end: Any, finish: int | None) -> None:
    async def main() -> None:
        # the consumer never sends a token: its first-token bound (token0_timeout_s) ends it
        async with Cluster(token0_timeout_s=0.5 if end is None else 10.0) as cl:
            p, c = await cl.pd(prefill=prefill_hang_after_token0,
                               decode=decode_hang_after_reserve)
            call = cl.router.Generate(request(request_id="r1"))
            first = await call.read()
            assert list(first.token_ids) == [TOKEN0]
            await wait_until(lambda: len(p.destinations) == 1)  # paired, both legs open
            if end is not None:
                await end(cl, call)
            if finish is not None:
                last = await call.read()
                assert last.finish_reason == finish, last
            await wait_until(lambda: p.aborts == ["r1"] and c.aborts == ["r1"])
            await wait_until(lambda: p.cancelled == ["r1"] and c.cancelled == ["r1"])
            assert cl.server.dispatcher is not None and not cl.server.dispatcher.active
            if end is _router_shutdown:
                return
            assert cl.server.registry is not None
            assert all(w.inflight == 0 for w in cl.server.registry.all())
            # and the router keeps serving: the next request is placed (and cut short)
            nxt = cl.router.Generate(request(request_id="r2"))
            try:
                assert list((await nxt.read()).token_ids) == [TOKEN0]
            except grpc.aio.AioRpcError as e:  # the wedged consumer was dropped
                assert end is _consumer_dropped and e.code() == grpc.StatusCode.UNAVAILABLE
            nxt.cancel()
            await asyncio.sleep(0)

    run(main())


def test_a_producer_dropped_after_its_transfer_does_not_fail_the_request() -> None:
    release = asyncio.Event()

    async def decode(w: Any, req: Any) -> Any:
        yield reserved()
        await release.wait()
        yield tokens([101], "B", LENGTH)

    async def main() -> None:
        async with Cluster() as cl:
            p, c = await cl.pd(decode=decode)  # prefill_ok: token 0, then the transfer result
            call = cl.router.Generate(request(request_id="r1"))
            assert list((await call.read()).token_ids) == [TOKEN0]
            assert cl.server.dispatcher is not None
            r = cl.server.dispatcher.active["r1"]
            await wait_until(lambda: "p0" in r.ended)  # the KV transfer reported ok
            p.heartbeating = False  # the producer goes quiet: the registry drops it
            await wait_until(lambda: cl.server.registry is not None
                             and cl.server.registry.get("p0") is None)
            release.set()
            rest = await read_all(call)
            assert rest[-1].finish_reason == LENGTH and not rest[-1].error, rest[-1].error

    run(main())
