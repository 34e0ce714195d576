"""A flood of huge prompts: the router tokenizes them in a bounded pool, so what it holds
stays bounded, the excess is refused at once (gRPC RESOURCE_EXHAUSTED, HTTP 429 with
Retry-After) naming the bound, small requests keep being served, and once the flood passes
huge prompts are accepted again. Real router (both doors), scripted colocated worker."""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import grpc
import pytest
from router_fakes import CO, Cluster, request, run

import router.requests.frontend
from router.requests import tokenize_pool
from router.requests.tokenize_pool import TokenizePool

HUGE = "lorem ipsum dolor sit amet " * 12000  # ~324K characters, ~60K tokens
MAX_PENDING = 3


@pytest.fixture
def pools(monkeypatch: pytest.MonkeyPatch) -> list[TokenizePool]:
    made: list[TokenizePool] = []

    class Recorded(TokenizePool):
        def __init__(self, *a: Any, **kw: Any) -> None:
            super().__init__(*a, **kw)
            made.append(self)

    monkeypatch.setattr(tokenize_pool, "MAX_PENDING", MAX_PENDING)
    monkeypatch.setattr(tokenize_pool, "THREADS", 1)
    monkeypatch.setattr(router.requests.frontend, "TokenizePool", Recorded)
    return made


async def grpc_outcome(cl: Cluster, prompt: str) -> tuple[Any, str, tuple[Any, ...]]:
    call = cl.router.Generate(request(prompt, max_tokens=3))
    try:
        [r async for r in call]
    except grpc.aio.AioRpcError as e:
        return e.code(), e.details() or "", tuple(e.trailing_metadata() or ())
    return grpc.StatusCode.OK, "", ()


def test_huge_prompt_flood_is_bounded_and_refused_clearly(pools: list[TokenizePool]) -> None:
    async def main() -> None:
        async with Cluster(http_port=0, heartbeat_timeout_s=60.0) as cl:
            await cl.add("w0", CO, max_model_len=1 << 20)
            pool = pools[0]
            flood = [asyncio.ensure_future(grpc_outcome(cl, HUGE)) for _ in range(24)]
            await asyncio.sleep(0)
            small = await grpc_outcome(cl, "Hello there")  # inline, not behind the flood
            assert small[0] == grpc.StatusCode.OK, small
            url = f"http://127.0.0.1:{cl.server.http_port}/v1/completions"
            async with aiohttp.ClientSession() as http:
                async def post() -> tuple[int, dict[str, Any], str]:
                    async with http.post(url, json={"prompt": HUGE, "max_tokens": 2}) as r:
                        return r.status, dict(r.headers), await r.text()

                answers = await asyncio.gather(*(post() for _ in range(12)))
            outcomes = await asyncio.gather(*flood)
            codes = [c for c, _, _ in outcomes]
            refused = [o for o in outcomes if o[0] == grpc.StatusCode.RESOURCE_EXHAUSTED]
            assert refused and codes.count(grpc.StatusCode.OK) >= 1, codes
            assert set(codes) <= {grpc.StatusCode.OK, grpc.StatusCode.RESOURCE_EXHAUSTED}
            for _, details, md in refused:
                assert details.startswith("overloaded:") and "tokenized" in details, details
                assert ("retry-after", "1") in md
            statuses = [s for s, _, _ in answers]
            assert set(statuses) <= {200, 429} and 429 in statuses, statuses
            for status, headers, body in answers:
                if status == 429:
                    assert headers.get("Retry-After") == "1" and "tokenized" in body, body
            # what the router held for tokenization never passed the bound
            assert pool.peak_pending <= MAX_PENDING
            assert pool.peak_chars <= MAX_PENDING * len(HUGE)
            assert pool.pending == 0 and pool.chars == 0
            assert await grpc_outcome(cl, HUGE) == (grpc.StatusCode.OK, "", ())

    run(main(), timeout=120)


def test_a_client_leaving_does_not_free_its_slot_before_its_thread_is_done() -> None:
    import threading

    from router.requests.errors import Overloaded

    async def main() -> None:
        pool = TokenizePool(threads=1, max_pending=1, max_chars=100)
        release = threading.Event()
        first = asyncio.ensure_future(pool.run(10, lambda: release.wait(10)))
        await asyncio.sleep(0.05)
        first.cancel()  # the client hung up; its text is still being tokenized
        with pytest.raises(Overloaded, match="at most 1"):
            await pool.run(10, lambda: 1)
        with pytest.raises(Overloaded):  # the character bound, on its own
            await TokenizePool(max_chars=100).run(101, lambda: 1)
        release.set()
        for _ in range(100):
            if pool.pending == 0:
                break
            await asyncio.sleep(0.02)
        assert pool.pending == 0 and pool.chars == 0
        assert await pool.run(10, lambda: 7) == 7
        assert pool.refused == 1
        pool.close()

    run(main(), timeout=30)
