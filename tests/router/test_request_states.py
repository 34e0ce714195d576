"""The router's request lifecycle (router/requests/request_run.py docstring): every router-side
state is reached on scripted workers, seen live through ClusterStatus(include_requests),
and every way out ends in the right FINISHED_* state."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import grpc
from pdserve.v1 import router_pb2
from prometheus_client.parser import text_string_to_metric_families
from router_fakes import (
    ABORT,
    CO,
    ERROR,
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

from router.requests.request_run import RequestRun
from router.requests.run_phase import RunPhase

S = RunPhase


class Gates:
    """One event per step a scripted worker waits for before its next message."""

    def __init__(self, *names: str) -> None:
        self.ev = {n: asyncio.Event() for n in names}

    async def wait(self, name: str) -> None:
        await self.ev[name].wait()

    def open(self, name: str) -> None:
        self.ev[name].set()


async def listed(cl: Cluster) -> dict[str, router_pb2.RequestStatus]:
    st = await cl.router.ClusterStatus(router_pb2.ClusterStatusRequest(include_requests=True))
    return {r.request_id: r for r in st.requests}


async def until_state(cl: Cluster, rid: str, state: str, timeout: float = 5.0
                      ) -> router_pb2.RequestStatus:
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    seen = None
    while loop.time() < end:
        seen = (await listed(cl)).get(rid)
        if seen is not None and seen.state == state:
            return seen
        await asyncio.sleep(0.01)
    raise AssertionError(f"{rid} never reached {state}; last seen {seen}")


def active_run(cl: Cluster, rid: str) -> RequestRun:
    assert cl.server.dispatcher is not None
    return cl.server.dispatcher.active[rid]


def test_disaggregated_request_walks_every_forward_state() -> None:
    g = Gates("reserve", "token0", "transfer", "decode", "finish")

    async def prefill(w: FakeWorker, req: Any, inputs: Any) -> Any:
        await next_destination(w, inputs)
        await g.wait("token0")
        yield token0()
        await g.wait("transfer")
        yield transfer()

    async def decode(w: FakeWorker, req: Any) -> Any:
        await g.wait("reserve")
        yield reserved()
        await g.wait("decode")
        yield tokens([101], "B", kv_ready_ns=1, first_step_ns=2)
        await g.wait("finish")
        yield tokens([102], "C", LENGTH)

    async def main() -> None:
        async with Cluster(max_running_requests=1, max_queued_requests=4) as cl:
            p, c = await cl.pd(prefill=prefill, decode=decode)
            # a first request holds the only running slot, so r1 waits in the queue
            blocker = asyncio.create_task(read_all(cl.router.Generate(request(request_id="r0"))))
            await until_state(cl, "r0", "PLACED")
            r1 = asyncio.create_task(read_all(cl.router.Generate(request(request_id="r1"))))
            q = await until_state(cl, "r1", "QUEUED")
            assert (q.producer, q.consumer, q.tokens_streamed) == ("", "", 0)
            assert [r.request_id for r in (await listed(cl)).values()] == ["r0", "r1"]
            for step in ("reserve", "token0", "transfer", "decode", "finish"):
                g.open(step)  # r0 runs through; r1 then takes its slot, gates all open
            out0 = await blocker
            assert out0[-1].finish_reason == LENGTH
            assert (await r1)[-1].finish_reason == LENGTH
            assert await listed(cl) == {}

            # the same walk again, one step at a time
            for ev in g.ev.values():
                ev.clear()
            call = cl.router.Generate(request(request_id="r2"))
            reader = asyncio.create_task(read_all(call))
            s = await until_state(cl, "r2", "PLACED")
            assert (s.producer, s.consumer, s.colocated) == ("p0", "c0", "")
            run2 = active_run(cl, "r2")
            g.open("reserve")
            await until_state(cl, "r2", "PAIRED")
            g.open("token0")
            s = await until_state(cl, "r2", "TOKEN0")
            g.open("transfer")
            await until_state(cl, "r2", "KV_LANDED")
            assert cl.server.metrics is not None
            gauges = {s.labels["state"]: s.value for f in text_string_to_metric_families(
                cl.server.metrics.render().decode()) for s in f.samples
                if s.name == "pdserve_router_requests_in_state"}
            assert gauges == {"QUEUED": 0, "PLACED": 0, "PAIRED": 0, "TOKEN0": 0,
                              "KV_LANDED": 1, "DECODING": 0}
            assert s.age_s > 0
            g.open("decode")
            s = await until_state(cl, "r2", "DECODING")
            assert s.tokens_streamed in (1, 2)  # the client loop may not have sent 101 yet
            g.open("finish")
            out = await reader
            assert [list(r.token_ids) for r in out] == [[TOKEN0], [101], [102]]
            assert run2.phase is S.FINISHED_LENGTH and run2.info().tokens_streamed == 3
            assert p.aborts == c.aborts == []

    run(main())


def test_token0_before_the_reservation_goes_straight_to_token0() -> None:
    g = Gates("reserve")

    async def decode(w: FakeWorker, req: Any) -> Any:
        await g.wait("reserve")
        yield reserved()
        yield tokens([101], "B", LENGTH)

    async def main() -> None:
        async with Cluster() as cl:
            await cl.pd(decode=decode)  # prefill_ok: token 0 at once, then waits for blocks
            call = cl.router.Generate(request(request_id="r1"))
            first = await call.read()
            assert list(first.token_ids) == [TOKEN0]
            s = await until_state(cl, "r1", "TOKEN0")
            assert s.tokens_streamed == 1
            g.open("reserve")
            run_ = active_run(cl, "r1")
            rest = await read_all(call)
            assert rest[-1].finish_reason == LENGTH and run_.phase is S.FINISHED_LENGTH

    run(main())


def test_consumer_tokens_before_token0_wait_with_it_then_both_mean_decoding() -> None:
    g = Gates("token0")

    async def prefill(w: FakeWorker, req: Any, inputs: Any) -> Any:
        await next_destination(w, inputs)
        await g.wait("token0")
        yield token0()
        yield transfer()

    async def decode(w: FakeWorker, req: Any) -> Any:
        yield reserved()
        yield tokens([101], "B")
        await asyncio.sleep(3600)

    async def main() -> None:
        async with Cluster() as cl:
            await cl.pd(prefill=prefill, decode=decode)
            call = cl.router.Generate(request(request_id="r1"))
            reader = asyncio.create_task(read_all(call))
            s = await until_state(cl, "r1", "PAIRED")
            await asyncio.sleep(0.2)  # the consumer's token 101 is in; token 0 is not
            s = (await listed(cl))["r1"]
            assert s.state == "PAIRED" and s.tokens_streamed == 0  # held back until token 0
            g.open("token0")
            end = time.monotonic() + 30  # the client loop hands token 0 and 101 on
            while (s := (await listed(cl))["r1"]).tokens_streamed < 2 and time.monotonic() < end:
                await asyncio.sleep(0.01)
            assert s.state == "DECODING" and s.tokens_streamed == 2
            call.cancel()
            await asyncio.gather(reader, return_exceptions=True)

    run(main())


def test_colocated_request_states() -> None:
    g = Gates("token0", "finish")

    async def decode(w: FakeWorker, req: Any) -> Any:
        await g.wait("token0")
        yield tokens([TOKEN0], "A")
        await g.wait("finish")
        yield tokens([103], "D", STOP, stop_reason="x")

    async def main() -> None:
        async with Cluster() as cl:
            await cl.add("w0", CO, decode=decode)
            reader = asyncio.create_task(read_all(cl.router.Generate(request(request_id="r1"))))
            s = await until_state(cl, "r1", "PLACED")
            assert (s.colocated, s.producer, s.consumer) == ("w0", "", "")
            run_ = active_run(cl, "r1")
            g.open("token0")
            await until_state(cl, "r1", "DECODING")
            g.open("finish")
            assert (await reader)[-1].finish_reason == STOP
            assert run_.phase is S.FINISHED_STOPPED

    run(main())


class Runs(dict[str, RequestRun]):
    """The dispatcher's table of requests in flight, remembering every run it held."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: dict[str, RequestRun] = {}

    def __setitem__(self, rid: str, r: RequestRun) -> None:
        self.seen[rid] = r
        super().__setitem__(rid, r)


def record_runs(cl: Cluster) -> Runs:
    assert cl.server.dispatcher is not None
    runs = cl.server.dispatcher.active = Runs()
    return runs


def test_every_way_out_sets_its_finished_state() -> None:
    async def stop_at_token0(w: FakeWorker, req: Any, inputs: Any) -> Any:
        yield token0(finish=STOP, stop_reason="2")
        async for _ in inputs:
            pass

    async def failed_transfer(w: FakeWorker, req: Any, inputs: Any) -> Any:
        yield token0()
        await next_destination(w, inputs)
        yield transfer(ok=False, error="peer reset")

    async def consumer_error(w: FakeWorker, req: Any) -> Any:
        yield reserved()
        yield tokens([], "", ERROR, error="KV checksum mismatch")

    async def main() -> None:
        async with Cluster() as cl:
            runs = record_runs(cl)
            p, c = await cl.pd(prefill=stop_at_token0, decode=decode_hang_after_reserve)

            async def ending(rid: str, act: Any = None) -> list[Any]:
                call = cl.router.Generate(request(request_id=rid))
                if act is not None:
                    await call.read()
                    await act(call)
                try:
                    return [r.finish_reason for r in await read_all(call)]
                except asyncio.CancelledError:  # our own call.cancel()
                    return [grpc.StatusCode.CANCELLED]

            assert await ending("stop") == [STOP]  # token 0 finished it
            assert runs.seen["stop"].phase is S.FINISHED_STOPPED

            p.prefill_script = prefill_hang_after_token0

            async def abort(call: Any) -> None:
                assert (await cl.router.Abort(router_pb2.AbortRequest(request_id="ab"))).ok

            assert (await ending("ab", abort))[-1] == ABORT
            assert runs.seen["ab"].phase is S.FINISHED_ABORTED

            async def hang_up(call: Any) -> None:
                call.cancel()

            assert await ending("gone", hang_up) == [grpc.StatusCode.CANCELLED]
            await wait_until(lambda: "gone" in c.aborts)  # the router saw the hang-up
            assert runs.seen["gone"].phase is S.FINISHED_ABORTED  # the client left

            p.prefill_script = failed_transfer
            assert (await ending("xfer"))[-1] == ERROR
            assert runs.seen["xfer"].phase is S.FINISHED_ERROR

            p.prefill_script, c.decode_script = prefill_hang_after_token0, consumer_error
            assert (await ending("cerr"))[-1] == ERROR
            assert runs.seen["cerr"].phase is S.FINISHED_ERROR
            assert set(runs.seen) == {"stop", "ab", "gone", "xfer", "cerr"} and not runs

    run(main())


def test_abort_while_queued_ends_without_starting_legs() -> None:
    async def main() -> None:
        async with Cluster(max_running_requests=1, max_queued_requests=4) as cl:
            p, c = await cl.pd(prefill=prefill_hang_after_token0,
                               decode=decode_hang_after_reserve)
            first = cl.router.Generate(request(request_id="r0"))
            await first.read()
            queued = asyncio.create_task(read_all(cl.router.Generate(request(request_id="r1"))))
            await until_state(cl, "r1", "QUEUED")
            run1 = active_run(cl, "r1")
            assert (await cl.router.Abort(router_pb2.AbortRequest(request_id="r1"))).ok
            out = await asyncio.wait_for(queued, 5)  # at once: r0 still holds the only slot
            assert cl.server.admission is not None
            assert (cl.server.admission.running, cl.server.admission.queued) == (1, 0)
            first.cancel()
            assert len(out) == 1 and out[0].finish_reason == ABORT
            assert out[0].usage.completion_tokens == 0
            assert run1.phase is S.FINISHED_ABORTED
            assert [r.request_id for r in p.prefill_requests] == ["r0"]
            assert [r.request_id for r in c.decode_requests] == ["r0"]
            assert "r1" not in p.aborts + c.aborts  # no leg to abort

    run(main())


def test_a_retry_moves_the_request_back_with_its_new_producer() -> None:
    async def crashes(w: FakeWorker, req: Any, inputs: Any) -> Any:
        await next_destination(w, inputs)  # reserved: PAIRED on p0
        raise RuntimeError("engine died")
        yield token0()  # pragma: no cover - makes this an async generator

    async def main() -> None:
        async with Cluster() as cl:
            await cl.add("p0", 1, prefill=crashes)
            await cl.add("p1", 1, prefill=prefill_hang_before_token0)
            await cl.add("c0", 2, decode=decode_hang_after_reserve)
            call = cl.router.Generate(request(request_id="r1"))
            reader = asyncio.create_task(read_all(call))
            s = await until_state_on(cl, "r1", "p1")  # p0's attempt is replaced
            assert (s.state, s.producer, s.consumer) == ("PAIRED", "p1", "c0")
            assert active_run(cl, "r1").attempt == 2
            call.cancel()
            await asyncio.gather(reader, return_exceptions=True)

    run(main())


async def prefill_hang_before_token0(w: FakeWorker, req: Any, inputs: Any) -> Any:
    await next_destination(w, inputs)
    await asyncio.sleep(3600)
    yield token0()


async def until_state_on(cl: Cluster, rid: str, producer: str) -> router_pb2.RequestStatus:
    for _ in range(500):
        s = (await listed(cl)).get(rid)
        if s is not None and s.producer == producer and s.state == "PAIRED":
            return s
        await asyncio.sleep(0.01)
    raise AssertionError(f"{rid} never reached PAIRED on {producer}")
