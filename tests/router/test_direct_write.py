"""A decoding request's tokens are written to the client's gRPC stream from the worker's
batch (router/requests/direct_write.py) when the client loop waits with nothing in hand:
the client gets the same tokens, text, logprobs and finish, in order, one message per
worker message, and the request's metrics count them; the real gRPC path (router server,
fake workers serving Outputs). The producer's token 0 goes the same way from its batch,
ahead of consumer tokens that overtook it."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest
from pdserve.v1 import common_pb2, router_pb2, router_pb2_grpc, worker_pb2
from router_fakes import (
    LENGTH,
    TOKEN0,
    Cluster,
    FakeWorker,
    decode_endless,
    read_all,
    request,
    reserved,
    run,
    tokens,
)

from router.requests.direct_write import DirectWrite

N = 40


def text_of(i: int) -> str:
    return f" t{i}"


def logprob(i: int) -> common_pb2.TokenLogprob:
    return common_pb2.TokenLogprob(token_id=i, logprob=-0.5 * i,
                                   top=[common_pb2.TopLogprob(token_id=i, logprob=-0.5 * i)])


async def paced_tokens(w: FakeWorker, req: worker_pb2.DecodeRequest
                       ) -> AsyncIterator[worker_pb2.DecodeOutput]:
    """One token per 10 ms step: the client loop is parked between them."""
    yield reserved()
    for i in range(1, N + 1):
        await asyncio.sleep(0.01)
        yield tokens([i], text_of(i), LENGTH if i == N else 0, logprobs=[logprob(i)])


@pytest.fixture
def direct_writes(monkeypatch: pytest.MonkeyPatch) -> list[list[int]]:
    """The token ids of each write started from a worker's batch (the real ``start`` still
    runs)."""
    started: list[list[int]] = []
    real = DirectWrite.start

    def counting(self: DirectWrite, message: Any) -> None:
        started.append(list(message.token_ids))
        real(self, message)

    monkeypatch.setattr(DirectWrite, "start", counting)
    return started


def test_steady_tokens_are_written_from_the_batch_in_order(
        direct_writes: list[list[int]]) -> None:
    async def main() -> tuple[list[router_pb2.GenerateResponse], bytes]:
        async with Cluster() as cl:
            await cl.pd(decode=paced_tokens)
            cl.workers[1].outputs = True
            got = await read_all(cl.router.Generate(request(max_tokens=N + 1, logprobs=1)))
            assert cl.server.metrics is not None
            return got, cl.server.metrics.render()

    got, metrics = run(main(), timeout=30)
    assert [i for r in got for i in r.token_ids] == [TOKEN0, *range(1, N + 1)]
    assert "".join(r.text for r in got) == "A" + "".join(text_of(i) for i in range(1, N + 1))
    lps = [lp for r in got[1:] for lp in r.logprobs]
    assert lps == [logprob(i) for i in range(1, N + 1)]
    assert all(r.request_id == got[0].request_id for r in got)
    assert got[-1].finish_reason == LENGTH
    assert got[-1].usage.completion_tokens == N + 1
    assert [r.finish_reason for r in got[:-1]] == [0] * (len(got) - 1)
    # most of the steady state went out from the batch, one token a message
    assert len(direct_writes) > N // 2, direct_writes
    assert {len(ids) for ids in direct_writes} == {1}
    assert len(got) == N + 1  # nothing merged: every token went out as it came
    # the request's metrics counted the tokens written from the batch too
    line = next(x for x in metrics.decode().splitlines()
                if x.startswith("pdserve_router_generation_tokens_total"))
    assert float(line.split()[-1]) == N + 1


def test_a_client_leaving_mid_stream_ends_the_request_on_the_worker(
        direct_writes: list[list[int]]) -> None:
    async def main() -> None:
        async with Cluster() as cl:
            _, c = await cl.pd(decode=decode_endless)
            c.outputs = True
            channel = grpc.aio.insecure_channel(cl.server.address)
            call: Any = router_pb2_grpc.RouterStub(channel).Generate(request(max_tokens=1000))
            seen = 0
            async for r in call:
                seen += len(r.token_ids)
                if seen > 30:
                    break
            call.cancel()
            await channel.close()
            d = cl.server.dispatcher
            assert d is not None
            for _ in range(200):  # the run's teardown aborts the consumer's request
                if (c.aborts or c.cancelled) and not d.active:
                    break
                await asyncio.sleep(0.01)
            assert c.aborts or c.cancelled
            assert not d.active
    run(main(), timeout=30)
    assert direct_writes  # the stream was being written from the batch when it left


def ttft_count(metrics: bytes) -> float:
    line = next(x for x in metrics.decode().splitlines()
                if x.startswith("pdserve_router_time_to_first_token_seconds_count"))
    return float(line.split()[-1])


def test_token0_is_written_from_the_producers_batch(direct_writes: list[list[int]]) -> None:
    """Token 0 on the producer's Outputs stream, the client loop parked: it leaves from the
    pass over that batch (before this, always through the client loop's task)."""
    async def main() -> tuple[list[router_pb2.GenerateResponse], bytes]:
        async with Cluster() as cl:
            p, c = await cl.pd(decode=paced_tokens)
            p.outputs = c.outputs = True
            p.token0_delay_s = 0.05  # a prefill's time: the client loop is parked by then
            got = await read_all(cl.router.Generate(request(max_tokens=N + 1)))
            assert cl.server.metrics is not None
            return got, cl.server.metrics.render()

    got, metrics = run(main(), timeout=30)
    assert [i for r in got for i in r.token_ids] == [TOKEN0, *range(1, N + 1)]
    assert got[0].token_ids == [TOKEN0] and got[0].text == "A"
    assert got[-1].usage.completion_tokens == N + 1
    assert direct_writes[0] == [TOKEN0], direct_writes[:3]
    assert ttft_count(metrics) == 1  # the direct write counted as the first token


async def decode_overtaking(w: FakeWorker, req: worker_pb2.DecodeRequest
                            ) -> AsyncIterator[worker_pb2.DecodeOutput]:
    """The consumer's first tokens come before the producer's (late) token 0."""
    yield reserved()
    yield tokens([101, 102], "BC")
    await asyncio.sleep(0.3)  # the client loop sends them on after token 0
    yield tokens([103], "D", LENGTH)


def test_token0_written_from_the_batch_goes_before_tokens_that_overtook_it(
        direct_writes: list[list[int]]) -> None:
    async def main() -> list[router_pb2.GenerateResponse]:
        async with Cluster() as cl:
            p, c = await cl.pd(decode=decode_overtaking)
            p.outputs = c.outputs = True
            p.token0_delay_s = 0.15
            return await read_all(cl.router.Generate(request(max_tokens=4)))

    got = run(main(), timeout=30)
    assert [i for r in got for i in r.token_ids] == [TOKEN0, 101, 102, 103]
    assert "".join(r.text for r in got) == "ABCD"
    assert got[-1].finish_reason == LENGTH
    assert direct_writes[0] == [TOKEN0], direct_writes
