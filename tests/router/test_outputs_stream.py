"""The router's end of the per-worker Outputs stream (router/requests/worker_outputs.py), against
scripted workers: tokens arrive batched and demultiplexed, a Decode stream's done waits for
the batch holding its last tokens, a worker without Outputs still works, and a broken
stream fails over like a broken Decode stream."""

from __future__ import annotations

import asyncio
from typing import Any

import grpc
from pdserve.v1 import worker_pb2
from router_fakes import CO, LENGTH, TOKEN0, Cluster, request, reserved, run, tokens

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
            assert len(subs) == 1 and "" not in subs  # one stream, named by every Decode
            assert len(c.decode_requests) == 6

    run(main())


def test_the_done_never_overtakes_the_last_tokens() -> None:
    """Each batch leaves 0.3 s late, so the Decode stream's done arrives first: the run must
    still see the final tokens before it takes the stream as ended (else: "ended its stream
    before the request finished")."""
    async def main() -> None:
        async with Cluster() as cl:
            p, c = await cl.pd()
            c.outputs, c.batch_delay_s = True, 0.3
            resps = await cl.generate(max_tokens=4)
            assert [i for r in resps for i in r.token_ids] == [TOKEN0, 101, 102, 103]
            assert resps[-1].finish_reason == LENGTH and not resps[-1].error, resps[-1]

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


def test_reserved_still_comes_on_the_decode_stream() -> None:
    async def main() -> None:
        async with Cluster() as cl:
            p, c = await cl.pd()
            c.outputs = True
            await cl.generate(max_tokens=4)
            assert p.destinations and list(p.destinations[0].block_ids) == list(
                reserved().reserved.block_ids)
            assert c.decode_requests[0].subscriber_id

    run(main())
