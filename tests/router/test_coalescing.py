"""A client that reads slowly gets the tokens that waited for it in fewer, larger messages:
the same tokens and text, in order, over the real gRPC path (router server, fake workers).

While the client does not read, HTTP/2 flow control stops the router's writes to it once
the stream's window is full; the run's queue keeps taking the worker's tokens, and the next
write carries every token that waited (router/requests/event_queue.py)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import grpc
from pdserve.v1 import router_pb2, router_pb2_grpc, worker_pb2
from router_fakes import (
    BURST,
    BURSTS,
    LENGTH,
    TOKEN0,
    Cluster,
    FakeWorker,
    burst_text,
    decode_bursts,
    request,
    reserved,
    run,
    tokens,
)

N = 600  # consumer tokens, each with a text of ~1 KB: far past one flow-control window
TEXT = 1000


def text_of(i: int) -> str:
    return f"{i:04d}" + "x" * (TEXT - 4)


async def many_tokens(w: FakeWorker, req: worker_pb2.DecodeRequest
                      ) -> AsyncIterator[worker_pb2.DecodeOutput]:
    yield reserved()
    for i in range(1, N + 1):
        yield tokens([i], text_of(i), LENGTH if i == N else 0)
        if i % 50 == 0:
            await asyncio.sleep(0)


def test_a_slow_reader_gets_every_token_in_fewer_messages() -> None:
    async def main() -> None:
        async with Cluster() as cl:
            await cl.pd(decode=many_tokens)
            cl.workers[1].outputs = True  # tokens come on the worker's Outputs stream
            # no BDP probing: the client's receive window stays at its 64 KiB default
            channel = grpc.aio.insecure_channel(cl.server.address,
                                                options=[("grpc.http2.bdp_probe", 0)])
            try:
                call: Any = router_pb2_grpc.RouterStub(channel).Generate(
                    request(max_tokens=N + 1))
                got: list[router_pb2.GenerateResponse] = [await call.read()]
                await asyncio.sleep(1.0)  # the slow reader: the worker finishes meanwhile
                while (r := await call.read()) is not grpc.aio.EOF:
                    got.append(r)
            finally:
                await channel.close()
        ids = [i for r in got for i in r.token_ids]
        assert ids == [TOKEN0, *range(1, N + 1)]
        assert "".join(r.text for r in got) == "A" + "".join(text_of(i) for i in
                                                             range(1, N + 1))
        assert got[-1].finish_reason == LENGTH
        assert got[-1].usage.completion_tokens == N + 1
        # ~64 messages fill the window; everything after waited and left together
        assert len(got) < N // 4, len(got)
        assert max(len(r.token_ids) for r in got) > N // 2

    run(main(), timeout=60)


def test_tokens_waiting_together_leave_in_one_message() -> None:
    """Several tokens of one request waiting when the stream's writer runs leave as one
    client message: the first of a burst may be written straight from the batch (nothing
    waits yet), the rest wait behind that write and leave merged."""
    async def main() -> None:
        async with Cluster() as cl:
            await cl.pd(decode=decode_bursts)
            cl.workers[1].outputs = cl.workers[1].batch_all = True
            got = await cl.generate(max_tokens=BURSTS * BURST + 1)
        ids = [i for r in got for i in r.token_ids]
        assert ids == [TOKEN0, *range(1, BURSTS * BURST + 1)]
        assert "".join(r.text for r in got) == burst_text()
        assert got[-1].finish_reason == LENGTH
        assert got[-1].usage.completion_tokens == BURSTS * BURST + 1
        # token 0, then at most two messages a burst (one written direct, the rest merged)
        sizes = [len(r.token_ids) for r in got]
        assert len(got) <= 1 + 2 * BURSTS, sizes

    run(main(), timeout=60)
