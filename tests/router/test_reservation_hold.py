"""While a consumer's reservation waits for blocks (backpressure), the router tells the
producer to keep holding the prefilled blocks, every ``hold_interval_s``; the holds stop
once the destination went out, and when the consumer is dropped (then the producer's lease
frees the blocks even if the router's abort never arrives)."""

from __future__ import annotations

import asyncio
from typing import Any

from router_fakes import (
    LENGTH,
    Cluster,
    FakeWorker,
    next_destination,
    request,
    reserved,
    run,
    token0,
    tokens,
    transfer,
    wait_until,
)

INTERVAL_S = 0.1


async def prefill_waits_for_destination(w: FakeWorker, req: Any, inputs: Any) -> Any:
    yield token0()
    await next_destination(w, inputs)
    yield transfer()


def decode_reserves_after(delay_s: float) -> Any:
    async def script(w: FakeWorker, req: Any) -> Any:
        await asyncio.sleep(delay_s)  # the reservation waits for blocks
        yield reserved()
        yield tokens([101, 102], "BC", kv_ready_ns=1, first_step_ns=1)
        yield tokens([103], "D", LENGTH)
    return script


def test_holds_while_the_reservation_waits_then_stop_at_the_destination() -> None:
    async def main() -> None:
        async with Cluster(hold_interval_s=INTERVAL_S) as cl:
            p, _ = await cl.pd(prefill=prefill_waits_for_destination,
                               decode=decode_reserves_after(1.0))
            out = await cl.generate(prompt="Hello there", max_tokens=4)
            assert out[-1].finish_reason == LENGTH and not out[-1].error
            assert len(p.destinations) == 1
            # about one per interval during the 1 s wait (a loaded CI machine sends fewer)
            assert 3 <= len(p.holds) <= 12, p.holds
            assert {c for _, c in p.holds} == {"c0"}
            n = len(p.holds)
            await asyncio.sleep(5 * INTERVAL_S)
            assert len(p.holds) == n  # none after the destination

    run(main())


def test_no_holds_when_the_consumer_reserves_at_once() -> None:
    async def main() -> None:
        async with Cluster(hold_interval_s=INTERVAL_S) as cl:
            p, _ = await cl.pd(prefill=prefill_waits_for_destination,
                               decode=decode_reserves_after(0.0))
            out = await cl.generate(prompt="Hello there", max_tokens=4)
            assert out[-1].finish_reason == LENGTH
            await asyncio.sleep(3 * INTERVAL_S)
            assert p.holds == []

    run(main())


def test_holds_stop_when_the_consumer_is_dropped() -> None:
    async def main() -> None:
        async with Cluster(hold_interval_s=INTERVAL_S, max_migrations=0) as cl:
            p, c = await cl.pd(prefill=prefill_waits_for_destination,
                               decode=decode_reserves_after(3600.0))
            call = cl.router.Generate(request(max_tokens=4))
            await wait_until(lambda: len(p.holds) >= 3)
            c.heartbeating = False  # it went quiet: the registry drops it
            outs = [r async for r in call]
            assert outs[-1].error, outs[-1]  # no other consumer: a clear error
            n = len(p.holds)
            await asyncio.sleep(5 * INTERVAL_S)
            assert len(p.holds) == n  # the producer hears no more holds: its lease runs out
            await wait_until(lambda: bool(p.cancelled or p.aborts))

    run(main())
