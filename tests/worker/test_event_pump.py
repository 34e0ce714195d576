"""The gRPC process's pump of engine-process events, over the real events link: a burst far
larger than one drain turn, and a message after the queue went quiet, all arrive in order."""

from __future__ import annotations

import asyncio

from live_bridge import live_bridge

from worker.messages import encode
from worker.servicer import DRAIN_BATCH
from worker.token_batch import TokensBatchEvent, TokensEvent


def step(n: int, finish: str | None = None) -> bytes:
    return encode(TokensBatchEvent.of([TokensEvent(rid, (n,), f"<{n}>", (), finish)
                                       for rid in ("a", "b")]))


def test_a_burst_and_a_late_event_are_all_routed_in_order() -> None:
    async def main() -> None:
        burst = 5 * DRAIN_BATCH
        async with live_bridge() as (bridge, push, pump):
            sub, _ = bridge.hub.subscribe("router-a")
            bridge.hub.attach("a", sub)
            qb = bridge.open("b")  # no subscriber: its events go to its own queue
            for n in range(burst):
                await push.send(step(n))
            got_a: list[int] = []
            while len(got_a) < burst:
                batch = await asyncio.wait_for(sub.next_batch(), 5)
                got_a += [t.token_ids[0] for t in batch.tokens]
            assert got_a == list(range(burst))
            ids_b: list[int] = []
            text_b = ""
            while len(ids_b) < burst:  # a queue that fills merges its events (losslessly)
                ev = await asyncio.wait_for(qb.get(), 5)
                assert isinstance(ev, TokensEvent)
                ids_b += ev.ids
                text_b += ev.text
            assert ids_b == list(range(burst))
            assert text_b == "".join(f"<{n}>" for n in range(burst))
            await asyncio.sleep(0.2)  # the queue went quiet; the descriptor must wake again
            await push.send(step(burst, "stop"))
            batch = await asyncio.wait_for(sub.next_batch(), 5)
            assert [(t.token_ids[0], t.finish_reason) for t in batch.tokens] == [(burst, 1)]
            ev = await asyncio.wait_for(qb.get(), 5)
            assert isinstance(ev, TokensEvent) and ev.finish == "stop"
            assert not pump.done()

    asyncio.run(main())
