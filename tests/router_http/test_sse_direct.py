"""The SSE door's decoding tokens are written from the worker's batch (router/http/
sse_direct.py): the stream's text is exact and in order, most chunks leave that way, and a
client that leaves mid-stream still gets its request aborted on the worker."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
from pdserve.v1 import worker_pb2
from router_fakes import (
    LENGTH,
    Cluster,
    FakeWorker,
    decode_endless,
    reserved,
    run,
    tokens,
    wait_until,
)

from router.http.sse_direct import SseStream

N = 40


async def steady_tokens(w: FakeWorker, req: worker_pb2.DecodeRequest
                        ) -> AsyncIterator[worker_pb2.DecodeOutput]:
    yield reserved()
    for i in range(1, N + 1):
        await asyncio.sleep(0.01)  # one token a step
        yield tokens([i], f"<{i}>", LENGTH if i == N else 0)


async def chat_stream(cl: Cluster) -> str:
    """A streamed chat completion of N + 1 tokens: the SSE body, after checking its status."""
    url = f"http://127.0.0.1:{cl.server.http_port}/v1/chat/completions"
    async with aiohttp.ClientSession() as s, s.post(url, json={
            "messages": [{"role": "user", "content": "hi"}], "stream": True,
            "max_tokens": N + 1}) as r:
        assert r.status == 200
        return await r.text()


def stream_text(body: str) -> str:
    """The stream's text, after checking it opens with the role chunk, ends with [DONE] and
    finishes on length."""
    events = [ln[6:] for ln in body.splitlines() if ln.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    return "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)


def test_steady_tokens_leave_from_the_batch_exact_and_in_order(
        monkeypatch: pytest.MonkeyPatch) -> None:
    direct, synchronous = [], []
    write, write_now = SseStream.write, SseStream.write_now

    async def counted(self: SseStream, resp: Any) -> None:
        direct.append(resp.text)
        await write(self, resp)

    def counted_now(self: SseStream, resp: Any) -> bool:
        taken = write_now(self, resp)
        if taken:
            direct.append(resp.text)
            synchronous.append(resp.text)
        return taken

    monkeypatch.setattr(SseStream, "write", counted)
    monkeypatch.setattr(SseStream, "write_now", counted_now)

    async def main() -> None:
        async with Cluster(http_port=0) as cl:
            await cl.pd(decode=steady_tokens)
            cl.workers[1].outputs = True
            body = await chat_stream(cl)
        text = stream_text(body)
        assert text == "A" + "".join(f"<{i}>" for i in range(1, N + 1))
        # token 0 and the last leave from the handler; the steady ones from the batch
        assert len(direct) >= N // 2, direct
        assert "".join(direct) in text
        # with nothing held by the client, the batch's chunks go straight to the transport
        assert len(synchronous) >= N // 2, synchronous

    run(main(), timeout=60)


def test_a_client_leaving_mid_stream_aborts_the_request() -> None:
    async def main() -> None:
        async with Cluster(http_port=0) as cl:
            _, c = await cl.pd(decode=decode_endless)
            c.outputs = True
            url = f"http://127.0.0.1:{cl.server.http_port}/v1/completions"
            async with aiohttp.ClientSession() as s, s.post(url, json={
                    "prompt": "x", "stream": True, "max_tokens": 1000}) as r:
                assert r.status == 200
                seen = 0
                async for line in r.content:
                    seen += line.startswith(b"data: {")
                    if seen == 10:
                        break  # leave: the connection closes with the session
            assert seen == 10
            await wait_until(lambda: len(c.aborts) == 1, timeout=10)
            await wait_until(lambda: not cl.server.dispatcher.requests(), timeout=10)

    run(main(), timeout=60)


def test_token0_from_the_producers_batch_still_opens_the_stream_in_the_handler() -> None:
    """Token 0 on the producer's Outputs stream with the client loop parked goes straight
    to a gRPC client (tests/router/test_direct_write.py); an SSE stream's first message is
    its handler's (it prepares the response and sends the role chunk first), so there it
    goes through the loop and the stream starts as always."""
    async def main() -> None:
        async with Cluster(http_port=0) as cl:
            p, c = await cl.pd(decode=steady_tokens)
            p.outputs = c.outputs = True
            p.token0_delay_s = 0.05  # the client loop is parked when it comes
            body = await chat_stream(cl)
        assert stream_text(body) == "A" + "".join(f"<{i}>" for i in range(1, N + 1))

    run(main(), timeout=60)
