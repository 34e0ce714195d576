"""A producer failing before token 0: the router places the request again, never on a
producer it failed on, at most ``prefill_retries`` times, then ends it with a clear error
(router/requests/request_run.py, "Retry")."""

from __future__ import annotations

import argparse
import asyncio
from typing import Any

import grpc
from pdserve.v1 import worker_pb2
from prometheus_client.parser import text_string_to_metric_families
from router_fakes import (
    CO,
    ERROR,
    LENGTH,
    TOKEN0,
    Cluster,
    FakeWorker,
    decode_hang_after_reserve,
    next_destination,
    prefill_ok,
    request,
    run,
    token0,
    wait_until,
)

from deploy.router_cmd import add_router_parser, router_config

P, C = 1, 2


def metric(cl: Cluster, name: str, **labels: str) -> float:
    assert cl.server.metrics is not None
    text = cl.server.metrics.render().decode()
    return next(s.value for f in text_string_to_metric_families(text) for s in f.samples
                if s.name == name and s.labels == labels)


async def prefill_crashes(w: FakeWorker, req: Any, inputs: Any) -> Any:
    """The producer's handler fails (gRPC status UNKNOWN) before any token."""
    await next_destination(w, inputs)
    raise RuntimeError("engine died")
    yield token0()  # pragma: no cover - makes this an async generator


async def prefill_ends_early(w: FakeWorker, req: Any, inputs: Any) -> Any:
    """The producer closes its stream cleanly but never sends token 0."""
    await next_destination(w, inputs)
    return
    yield token0()  # pragma: no cover


def test_producer_error_before_token0_is_retried_on_another_producer() -> None:
    async def main() -> None:
        async with Cluster() as cl:
            p0 = await cl.add("p0", P, prefill=prefill_crashes)
            p1 = await cl.add("p1", P, prefill=prefill_ok)
            c = await cl.add("c0", C)
            out = await cl.generate(request_id="r1", max_tokens=4)
            # the client sees one clean stream, as if nothing failed
            assert [list(r.token_ids) for r in out] == [[TOKEN0], [101, 102], [103]]
            assert out[-1].finish_reason == LENGTH and not out[-1].error
            assert out[-1].usage.completion_tokens == 4
            assert (out[-1].timing.producer, out[-1].timing.consumer) == ("p1", "c0")
            # each attempt under its own worker-side id; the failed one aborted on both legs
            assert [r.request_id for r in p0.prefill_requests] == ["r1"]
            assert [r.request_id for r in p1.prefill_requests] == ["r1#retry1"]
            assert [r.request_id for r in c.decode_requests] == ["r1", "r1#retry1"]
            assert p1.prefill_requests[0].seed == c.decode_requests[1].seed \
                == c.decode_requests[0].seed == p0.prefill_requests[0].seed
            await wait_until(lambda: "r1" in c.aborts and "r1" in p0.aborts)
            assert p1.aborts == [] and "r1#retry1" not in c.aborts
            (dest,) = p1.destinations
            assert dest.consumer_id == "c0"
            assert cl.server.registry is not None
            assert all(w.inflight == 0 for w in cl.server.registry.all())
            assert metric(cl, "pdserve_router_prefill_retries_total") == 1.0

    run(main())


def test_a_killed_producer_is_retried_and_the_request_may_go_colocated() -> None:
    async def main() -> None:
        async with Cluster() as cl:
            async def prefill(w: FakeWorker, req: Any, inputs: Any) -> Any:
                await next_destination(w, inputs)
                asyncio.get_running_loop().create_task(w.kill())
                await asyncio.sleep(3600)
                yield token0()

            p0 = await cl.add("p0", P, prefill=prefill)
            c = await cl.add("c0", C, decode=decode_hang_after_reserve)
            co = await cl.add("w0", CO)
            # least_loaded at idle: p0 (fewest dispatched, first by id) takes it first
            out = await cl.generate(request_id="r1")
            assert out[-1].finish_reason == LENGTH, out[-1].error
            assert [list(r.token_ids) for r in out] == [[TOKEN0], [103]]
            t = out[-1].timing
            assert (t.colocated, t.producer, t.consumer) == ("w0", "", "")
            assert [r.request_id for r in p0.prefill_requests] == ["r1"]
            assert [(r.request_id, r.colocated) for r in co.decode_requests] == [
                ("r1#retry1", True)]
            await wait_until(lambda: c.aborts == ["r1"])

    run(main())


def test_retries_are_bounded_then_a_clear_error() -> None:
    async def main() -> None:
        async with Cluster(prefill_retries=1) as cl:
            ps = [await cl.add(f"p{i}", P, prefill=prefill_ends_early) for i in range(3)]
            c = await cl.add("c0", C, decode=decode_hang_after_reserve)
            out = await cl.generate(request_id="r1")
            assert len(out) == 1 and out[0].finish_reason == ERROR
            err = out[0].error
            assert "ended its stream before token 0" in err, err
            assert "attempt 2 of 2" in err and "p0, p1" in err, err
            assert [len(p.prefill_requests) for p in ps] == [1, 1, 0]
            assert metric(cl, "pdserve_router_prefill_retries_total") == 1.0
            await wait_until(lambda: sorted(c.aborts) == ["r1", "r1#retry1"])

    run(main())


def test_no_other_producer_ends_with_a_clear_error() -> None:
    async def main() -> None:
        async with Cluster() as cl:
            p = await cl.add("p0", P, prefill=prefill_crashes)
            c = await cl.add("c0", C, decode=decode_hang_after_reserve)
            out = await cl.generate(request_id="r1")
            assert len(out) == 1 and out[0].finish_reason == ERROR
            assert "producer p0" in out[0].error and "engine died" in out[0].error
            assert "no other producer to retry on (tried p0)" in out[0].error
            await wait_until(lambda: c.aborts == ["r1"] and p.aborts == ["r1"])

    run(main())


def test_no_retry_once_token0_was_sent() -> None:
    async def prefill(w: FakeWorker, req: Any, inputs: Any) -> Any:
        yield token0()
        await next_destination(w, inputs)
        raise RuntimeError("engine died after token 0")

    async def main() -> None:
        # no prefill retry; the later failure would migrate (test_migration.py), not here
        async with Cluster(max_migrations=0) as cl:
            p0 = await cl.add("p0", P, prefill=prefill)
            p1 = await cl.add("p1", P)
            await cl.add("c0", C, decode=decode_hang_after_reserve)
            out = await cl.generate(request_id="r1")
            assert list(out[0].token_ids) == [TOKEN0]
            assert out[-1].finish_reason == ERROR and "engine died after token 0" in out[-1].error
            assert len(p0.prefill_requests) == 1 and p1.prefill_requests == []

    run(main())


def test_the_cli_flag_sets_the_bound() -> None:
    p = argparse.ArgumentParser()
    add_router_parser(p.add_subparsers(dest="command"))
    assert router_config(p.parse_args(["router"])).prefill_retries == 2
    assert router_config(p.parse_args(["router", "--prefill-retries", "0"])).prefill_retries == 0


async def prefill_busy(w: FakeWorker, req: Any, inputs: Any) -> Any:
    """The producer's engine queue is full: refused before any prefill (TransferResult busy)."""
    yield worker_pb2.PrefillOutput(transfer=worker_pb2.TransferResult(
        ok=False, busy=True, error="producer busy: waiting queue is full (1024 requests)"))


def test_a_busy_producer_sends_the_request_to_another_producer() -> None:
    async def main() -> None:
        async with Cluster() as cl:
            p0 = await cl.add("p0", P, prefill=prefill_busy)
            p1 = await cl.add("p1", P, prefill=prefill_ok)
            c = await cl.add("c0", C)
            out = await cl.generate(request_id="r1", max_tokens=4)
            assert [list(r.token_ids) for r in out] == [[TOKEN0], [101, 102], [103]]
            assert out[-1].finish_reason == LENGTH and not out[-1].error
            assert [r.request_id for r in p0.prefill_requests] == ["r1"]
            assert [r.request_id for r in p1.prefill_requests] == ["r1#retry1"]
            # the consumer was not blamed: the same one took the retry
            assert c.decode_requests[-1].request_id == "r1#retry1"
            assert (out[-1].timing.producer, out[-1].timing.consumer) == ("p1", "c0")

    run(main())


def test_a_busy_producer_with_none_other_is_a_clean_refusal() -> None:
    """No other producer: RESOURCE_EXHAUSTED with a retry hint before any response (a 429
    over HTTP), the consumer's reservation aborted; the producer is not dropped."""
    async def main() -> None:
        async with Cluster() as cl:
            await cl.add("p0", P, prefill=prefill_busy)
            c = await cl.add("c0", C, decode=decode_hang_after_reserve)
            call = cl.router.Generate(request(request_id="r1", max_tokens=4))
            got = [r async for r in _until_error(call)]
            assert got == []  # refused before the stream started
            assert await call.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            details = await call.details()
            assert "producer p0" in details and "waiting queue is full" in details, details
            assert "retry later" in details, details
            trailers = dict(await call.trailing_metadata())
            assert trailers.get("retry-after") == "1", trailers
            await wait_until(lambda: "r1" in c.aborts)
            assert cl.server.registry is not None
            assert cl.server.registry.get("p0") is not None  # busy is not dead
            assert all(w.inflight == 0 for w in cl.server.registry.all())

    run(main())


async def _until_error(call: Any) -> Any:
    try:
        async for r in call:
            yield r
    except grpc.aio.AioRpcError:
        return
