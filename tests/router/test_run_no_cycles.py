"""A finished request leaves no reference cycle in the router: its run, legs, tasks and
calls go by reference counting, not by the cyclic collector. Each request used to leave
~100 objects in one cycle (the legs' report called back into the run, which held the legs);
at c=256 a full collection then freed ~25k of them in one 15-60 ms stop of the router's
loop, which held every stream's next message (the first-token hold's tail,
bench/RESULTS.md, session 38). gc's DEBUG_SAVEALL keeps what a collection found unreachable,
so the test reads what would have been cyclic garbage."""

from __future__ import annotations

import asyncio
import gc
from collections import Counter

import pytest
from router_fakes import CO, C, Cluster, P, decode_endless, request, run

# the router's own objects; grpc's server keeps a few small cycles of its own per RPC
# (its method-handler lookup), which this does not count
OURS = ("router.",)


def _router_garbage() -> Counter[str]:
    gc.collect()
    return Counter(type(o).__qualname__ for o in gc.garbage
                   if str(getattr(type(o), "__module__", "")).startswith(OURS))


@pytest.mark.parametrize("layout", ["pd_outputs", "pd_streams", "colocated"])
def test_finished_requests_leave_no_cycle(layout: str) -> None:
    async def main() -> Counter[str]:
        # hold renewals every 50 ms: a run's renewal task lets it go at its next tick
        async with Cluster(hold_interval_s=0.05) as cl:
            outputs = layout != "pd_streams"
            if layout == "colocated":
                await cl.add("w0", CO, outputs=outputs)
            else:
                await cl.add("p0", P, outputs=outputs)
                await cl.add("c0", C, outputs=outputs)
            await asyncio.gather(*(cl.generate(max_tokens=4) for _ in range(2)))  # warm
            gc.collect()
            gc.set_debug(gc.DEBUG_SAVEALL)
            try:
                gc.garbage.clear()
                got = await asyncio.gather(*(cl.generate(max_tokens=4) for _ in range(6)))
                assert all(resps[-1].finish_reason for resps in got)
                await asyncio.sleep(0.3)  # the legs' lingering and the renewals end
                return _router_garbage()
            finally:
                gc.set_debug(0)
                gc.garbage.clear()

    assert run(main()) == Counter()


def test_a_request_the_client_left_leaves_no_cycle() -> None:
    """Cancelled mid-stream by its client: the run closes from the cancelled handler, its
    legs are aborted on the workers, and still nothing of it is left for the collector."""
    async def main() -> Counter[str]:
        async with Cluster(hold_interval_s=0.05) as cl:
            await cl.add("p0", P, outputs=True)
            await cl.add("c0", C, outputs=True, decode=decode_endless)

            async def leave() -> None:
                call = cl.router.Generate(request(max_tokens=1000))
                n = 0
                async for _ in call:
                    n += 1
                    if n == 3:
                        call.cancel()
                        return

            await leave()  # warm
            gc.collect()
            gc.set_debug(gc.DEBUG_SAVEALL)
            try:
                gc.garbage.clear()
                await asyncio.gather(*(leave() for _ in range(4)))
                await asyncio.sleep(0.5)  # the aborts, the renewals and the legs end
                return _router_garbage()
            finally:
                gc.set_debug(0)
                gc.garbage.clear()

    assert run(main()) == Counter()
