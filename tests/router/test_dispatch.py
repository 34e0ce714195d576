"""The request flow against scripted in-process workers (docs/architecture.md)."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import time
from typing import Any

import grpc
from pdserve.v1 import router_pb2
from router_fakes import (
    ABORT,
    BLOCKS,
    CO,
    ERROR,
    KV_ADDR,
    LENGTH,
    STOP,
    TOKEN0,
    Cluster,
    FakeWorker,
    decode_hang_after_reserve,
    next_destination,
    prefill_hang_after_token0,
    read_all,
    request,
    reserved,
    run,
    token0,
    tokens,
    transfer,
    wait_until,
)


def test_pd_flow_token0_first_then_consumer_tokens(tokenizer: Any) -> None:
    async def main() -> None:
        async with Cluster() as cl:
            p, c = await cl.pd()
            out = await cl.generate(prompt="Hello there", max_tokens=4, seed=1234,
                                    request_id="r1")
            assert [list(r.token_ids) for r in out] == [[TOKEN0], [101, 102], [103]]
            assert "".join(r.text for r in out) == "ABCD"
            assert all(r.request_id == "r1" for r in out)
            assert [r.finish_reason for r in out] == [0, 0, LENGTH]
            last = out[-1]
            ids = tokenizer.encode("Hello there")
            assert last.usage.prompt_tokens == len(ids)
            assert last.usage.completion_tokens == 4
            # both legs: one id, the router's tokens, the same resolved seed
            (preq,), (dreq,) = p.prefill_requests, c.decode_requests
            assert preq.request_id == dreq.request_id == "r1"
            assert list(preq.prompt_token_ids) == list(dreq.prompt_token_ids) == ids
            assert preq.seed == dreq.seed == 1234 and not dreq.colocated
            (dest,) = p.destinations
            assert dest.consumer_id == "c0" and dest.kv_address == KV_ADDR
            assert list(dest.block_ids) == BLOCKS
            t = last.timing
            assert (t.producer, t.consumer, t.colocated) == ("p0", "c0", "")
            assert t.router_received_ns <= t.router_token0_sent_ns <= t.router_finished_ns
            assert 0 < t.producer_received_ns < t.producer_token0_sampled_ns \
                < t.producer_token0_sent_ns <= t.router_token0_sent_ns
            assert t.consumer_kv_ready_ns and t.consumer_first_step_ns
            # the consumer's stamps up to the admission, as its first tokens carried them
            assert (t.producer_notice_sent_ns, t.consumer_notice_seen_ns,
                    t.consumer_kv_done_ns) == tuple(t.consumer_kv_ready_ns - d
                                                    for d in (3_000, 2_000, 1_000))
            assert t.kv_transfer_ms == 1.5
            # a successful request aborts nothing and cancels no stream
            await asyncio.sleep(0.1)
            assert p.aborts == c.aborts == p.cancelled == c.cancelled == []
            # no seed: the router draws one and both legs get it
            await cl.generate(request_id="r2")
            assert p.prefill_requests[1].seed == c.decode_requests[1].seed != 0

    run(main())


def test_token0_finishes_request_and_consumer_is_aborted() -> None:
    async def prefill(w: FakeWorker, req: Any, inputs: Any) -> Any:
        yield token0(finish=STOP, stop_reason="2")
        async for _ in inputs:  # ends when the router half-closes
            pass

    async def main() -> None:
        async with Cluster() as cl:
            p, c = await cl.pd(prefill=prefill, decode=decode_hang_after_reserve)
            out = await cl.generate(request_id="r1")
            assert len(out) == 1
            (r,) = out
            assert list(r.token_ids) == [TOKEN0] and r.finish_reason == STOP
            assert r.stop_reason == "2" and r.usage.completion_tokens == 1
            await asyncio.wait_for(c.abort_event.wait(), 5)
            assert c.aborts == ["r1"]
            # The consumer's stream is cancelled if its handler had started by then (token 0
            # can win that race; then only the Abort reaches it). The producer's stream ends
            # by the router's half-close or, failing that, by its cancel after the linger
            # bound (two full-suite CI runs saw the half-close not land within 5 s; not
            # reproduced alone): either way it gets no Abort, its work ended at token 0.
            await wait_until(lambda: (p.inputs_closed == ["r1"] or p.cancelled == ["r1"])
                             and c.cancelled == [r.request_id for r in c.decode_requests],
                             timeout=10.0)
            assert p.aborts == []

    run(main())


def test_token0_is_sent_before_a_delayed_reservation() -> None:
    reservation_sent = asyncio.Event

    async def main() -> None:
        gate = reservation_sent()

        async def decode(w: FakeWorker, req: Any) -> Any:
            await gate.wait()  # the consumer's KV pool is "full" until the client saw token 0
            yield reserved()
            yield tokens([101], "B", LENGTH, kv_ready_ns=1, first_step_ns=2)

        async with Cluster() as cl:
            p, c = await cl.pd(decode=decode)
            stream = cl.router.Generate(request())
            first = await stream.read()
            assert list(first.token_ids) == [TOKEN0] and not p.destinations
            gate.set()
            rest = await read_all(stream)
            assert [list(r.token_ids) for r in rest] == [[101]]
            assert rest[-1].finish_reason == LENGTH
            # the destination and the consumer's tokens leave the router side by side: the
            # client may see its last token before the producer has read the destination
            await wait_until(lambda: bool(p.destinations))
            assert len(p.destinations) == 1

    run(main())


def test_consumer_tokens_overtaking_token0_are_held_back() -> None:
    async def prefill(w: FakeWorker, req: Any, inputs: Any) -> Any:
        await next_destination(w, inputs)
        await asyncio.sleep(0.2)  # the consumer's tokens reach the router first
        yield token0()
        yield transfer()

    async def decode(w: FakeWorker, req: Any) -> Any:
        yield reserved()
        yield tokens([101], "B")
        yield tokens([102], "C", LENGTH)

    async def main() -> None:
        async with Cluster() as cl:
            await cl.pd(prefill=prefill, decode=decode)
            out = await cl.generate()
            assert [list(r.token_ids) for r in out] == [[TOKEN0], [101], [102]]

    run(main())


def test_transfer_failure_ends_with_error_and_aborts_consumer() -> None:
    async def prefill(w: FakeWorker, req: Any, inputs: Any) -> Any:
        yield token0()
        await next_destination(w, inputs)
        yield transfer(ok=False, error="peer reset")

    async def main() -> None:
        async with Cluster() as cl:
            p, c = await cl.pd(prefill=prefill, decode=decode_hang_after_reserve)
            out = await cl.generate(request_id="r1")
            last = out[-1]
            assert last.finish_reason == ERROR
            assert "p0" in last.error and "c0" in last.error and "peer reset" in last.error
            assert last.usage.completion_tokens == 1
            await asyncio.wait_for(c.abort_event.wait(), 5)
            assert c.aborts == ["r1"] and p.aborts == []

    run(main())


def test_consumer_dies_mid_stream() -> None:
    async def main() -> None:
        async with Cluster() as cl:
            async def decode(w: FakeWorker, req: Any) -> Any:
                yield reserved()
                yield tokens([101], "B")
                await asyncio.sleep(0.05)
                asyncio.get_running_loop().create_task(w.kill())
                await asyncio.sleep(3600)

            p, c = await cl.pd(prefill=prefill_hang_after_token0, decode=decode)
            out = await cl.generate(request_id="r1")
            assert [list(r.token_ids) for r in out[:2]] == [[TOKEN0], [101]]
            last = out[-1]
            assert last.finish_reason == ERROR and "consumer c0" in last.error, last.error
            await asyncio.wait_for(p.abort_event.wait(), 5)
            assert p.aborts == ["r1"]
            # the router stops pairing with it (at once, or at the heartbeat timeout)
            await wait_until(lambda: cl.server.registry is not None
                             and cl.server.registry.get("c0") is None)
            status = await cl.router.ClusterStatus(router_pb2.ClusterStatusRequest())
            assert [w.worker_id for w in status.workers] == ["p0"]
            try:
                await cl.generate()
                raise AssertionError("expected UNAVAILABLE")
            except grpc.aio.AioRpcError as e:
                assert e.code() == grpc.StatusCode.UNAVAILABLE

    run(main())


def test_producer_dies_before_token0() -> None:
    async def main() -> None:
        async with Cluster() as cl:
            async def prefill(w: FakeWorker, req: Any, inputs: Any) -> Any:
                await asyncio.sleep(0.05)
                asyncio.get_running_loop().create_task(w.kill())
                await asyncio.sleep(3600)
                yield token0()

            p, c = await cl.pd(prefill=prefill, decode=decode_hang_after_reserve)
            out = await cl.generate(request_id="r1")
            assert len(out) == 1 and out[0].finish_reason == ERROR
            assert "producer p0" in out[0].error, out[0].error
            await asyncio.wait_for(c.abort_event.wait(), 5)
            assert c.aborts == ["r1"]

    run(main())


def test_client_cancel_aborts_both_legs() -> None:
    async def main() -> None:
        async with Cluster() as cl:
            p, c = await cl.pd(prefill=prefill_hang_after_token0,
                               decode=decode_hang_after_reserve)
            call = cl.router.Generate(request(request_id="r1"))
            first = await call.read()
            assert list(first.token_ids) == [TOKEN0]
            await wait_until(lambda: len(p.destinations) == 1)
            call.cancel()
            await asyncio.wait_for(asyncio.gather(p.abort_event.wait(), c.abort_event.wait()), 5)
            assert p.aborts == c.aborts == ["r1"]
            await wait_until(lambda: p.cancelled == ["r1"] and c.cancelled == ["r1"])
            assert cl.server.dispatcher is not None and not cl.server.dispatcher.active
            # the in-flight counts went back to zero
            assert cl.server.registry is not None
            assert all(w.inflight == 0 for w in cl.server.registry.all())

    run(main())


def test_router_abort_ends_request_and_aborts_both_legs() -> None:
    async def main() -> None:
        async with Cluster() as cl:
            p, c = await cl.pd(prefill=prefill_hang_after_token0,
                               decode=decode_hang_after_reserve)
            call = cl.router.Generate(request(request_id="r1"))
            await call.read()
            ok = await cl.router.Abort(router_pb2.AbortRequest(request_id="r1"))
            assert ok.ok
            rest = await read_all(call)
            assert len(rest) == 1 and rest[0].finish_reason == ABORT
            assert rest[0].usage.completion_tokens == 1
            await asyncio.wait_for(asyncio.gather(p.abort_event.wait(), c.abort_event.wait()), 5)
            unknown = await cl.router.Abort(router_pb2.AbortRequest(request_id="nope"))
            assert not unknown.ok

    run(main())


def test_token0_timeout_is_an_error_naming_the_producer() -> None:
    async def prefill(w: FakeWorker, req: Any, inputs: Any) -> Any:
        await asyncio.sleep(3600)
        yield token0()

    async def main() -> None:
        async with Cluster(token0_timeout_s=0.3) as cl:
            p, c = await cl.pd(prefill=prefill, decode=decode_hang_after_reserve)
            out = await cl.generate(request_id="r1")
            assert out[-1].finish_reason == ERROR
            assert "token 0 from producer p0 within 0.3 s" in out[-1].error
            await asyncio.wait_for(asyncio.gather(p.abort_event.wait(), c.abort_event.wait()), 5)

    run(main())


def test_consumer_error_finish_is_forwarded() -> None:
    async def decode(w: FakeWorker, req: Any) -> Any:
        yield reserved()
        yield tokens([], "", ERROR, error="KV checksum mismatch")

    async def main() -> None:
        async with Cluster() as cl:
            await cl.pd(decode=decode)
            out = await cl.generate()
            assert out[-1].finish_reason == ERROR
            assert out[-1].error == "consumer c0: KV checksum mismatch"

    run(main())


def test_dropped_worker_fails_its_requests() -> None:
    async def main() -> None:
        async with Cluster() as cl:
            p, c = await cl.pd(prefill=prefill_hang_after_token0,
                               decode=decode_hang_after_reserve)
            call = cl.router.Generate(request(request_id="r1"))
            await call.read()
            c.heartbeating = False  # wedged but its server still answers
            rest = await read_all(call)
            assert rest[-1].finish_reason == ERROR
            assert "c0" in rest[-1].error and "stopped heartbeating" in rest[-1].error
            await asyncio.wait_for(asyncio.gather(p.abort_event.wait(), c.abort_event.wait()), 5)

    run(main())


def test_colocated_worker_serves_alone() -> None:
    async def main() -> None:
        async with Cluster() as cl:
            w = await cl.add("w0", CO)
            out = await cl.generate(request_id="r1")
            assert [list(r.token_ids) for r in out] == [[TOKEN0], [103]]
            assert out[-1].finish_reason == LENGTH and out[-1].usage.completion_tokens == 2
            t = out[-1].timing
            assert (t.colocated, t.producer, t.consumer) == ("w0", "", "")
            assert t.router_token0_sent_ns and t.consumer_first_step_ns
            assert w.decode_requests[0].colocated and not w.aborts

    run(main())


def test_mixed_cluster_round_robin_uses_pairs_and_colocated() -> None:
    async def main() -> None:
        async with Cluster(policy="round_robin") as cl:
            p, c = await cl.pd()
            w = await cl.add("w0", CO)
            for _ in range(4):
                await cl.generate()
            assert len(p.prefill_requests) == len(c.decode_requests) == 2
            assert len(w.decode_requests) == 2

    run(main())


def test_concurrent_requests_spread_over_two_pairs() -> None:
    async def main() -> None:
        async with Cluster(policy="least_loaded") as cl:
            ps = [await cl.add(f"p{i}", 1) for i in range(2)]
            cs = [await cl.add(f"c{i}", 2) for i in range(2)]
            outs = await asyncio.gather(*(cl.generate(request_id=f"r{i}") for i in range(8)))
            assert all(o[-1].finish_reason == LENGTH for o in outs)
            assert [len(p.prefill_requests) for p in ps] == [4, 4]
            assert [len(c.decode_requests) for c in cs] == [4, 4]

    run(main())


def test_killed_consumer_process_ends_request_with_error_and_is_dropped() -> None:
    """A real crash (SIGKILL of the worker's process), not an in-process server stop."""
    here = os.path.dirname(os.path.abspath(__file__))

    async def main() -> None:
        async with Cluster(heartbeat_timeout_s=30.0) as cl:  # only the RPC error can tell
            p = await cl.add("p0", 1, prefill=prefill_hang_after_token0)
            proc = await asyncio.create_subprocess_exec(
                sys.executable, os.path.join(here, "fake_worker_main.py"), cl.server.address,
                "c0", stdout=asyncio.subprocess.PIPE)
            try:
                assert proc.stdout is not None
                assert (await proc.stdout.readline()).strip() == b"ready"
                call = cl.router.Generate(request(request_id="r1"))
                assert list((await call.read()).token_ids) == [TOKEN0]
                assert list((await call.read()).token_ids) == [101]
                proc.send_signal(signal.SIGKILL)
                t0 = time.monotonic()
                rest = await read_all(call)
                assert time.monotonic() - t0 < 5.0
                assert rest[-1].finish_reason == ERROR and "consumer c0" in rest[-1].error
                await asyncio.wait_for(p.abort_event.wait(), 5)
                assert cl.server.registry is not None and cl.server.registry.get("c0") is None
            finally:
                if proc.returncode is None:
                    proc.kill()
                await proc.wait()

    run(main())
