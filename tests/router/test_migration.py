"""A worker failing a request after its client got tokens: the router migrates it to
another slot with those tokens as ``prior_output_ids`` and the client's stream goes on
without a repeat or a gap (router/requests/request_run.py, "Migration"). The fakes play a model
whose output position i is token 100 + i, so any repeat or gap shows in the ids."""

from __future__ import annotations

import argparse
import asyncio
from typing import Any

import pytest
from router_fakes import (
    CO,
    ERROR,
    LENGTH,
    Cluster,
    FakeWorker,
    next_destination,
    reserved,
    run,
    token0,
    tokens,
    transfer,
    wait_until,
)
from test_prefill_retry import metric

from deploy.router_cmd import add_router_parser, router_config
from router.config import RouterConfig

P, C = 1, 2
MAX = 8
# failures here come from the streams; a loaded CI machine must not drop a fake worker
HB = 5.0


def tok(i: int) -> int:
    return 100 + i


def model_token0(req: Any) -> Any:
    out = token0(tok(len(req.prior_output_ids)))
    out.token0.text = f"<{len(req.prior_output_ids)}>"
    return out


async def prefill_model(w: FakeWorker, req: Any, inputs: Any) -> Any:
    yield model_token0(req)
    await next_destination(w, inputs)
    yield transfer()


def decode_model(fail_after: int | None = None, how: str = "raise") -> Any:
    """A consumer (or colocated worker) that streams one token per message; after
    ``fail_after`` tokens of its own it fails: raises, ends its stream, dies, or hangs."""
    async def script(w: FakeWorker, req: Any) -> Any:
        n = len(req.prior_output_ids)
        if not req.colocated:
            yield reserved()
            n += 1  # token 0 comes from the producer
        sent = 0
        for i in range(n, MAX):
            if fail_after is not None and sent == fail_after:
                if how == "eof":
                    return
                if how == "kill":
                    asyncio.get_running_loop().create_task(w.kill())
                if how in ("kill", "hang"):
                    await asyncio.sleep(3600)
                raise RuntimeError("consumer engine died")
            yield tokens([tok(i)], f"<{i}>", LENGTH if i == MAX - 1 else 0)
            sent += 1
            await asyncio.sleep(0.01)
    return script


def ids(out: list[Any]) -> list[int]:
    return [t for r in out for t in r.token_ids]


def test_consumer_failing_mid_decode_migrates_to_the_other_consumer() -> None:
    async def main() -> None:
        async with Cluster(policy="round_robin", heartbeat_timeout_s=HB) as cl:
            p = await cl.add("p0", P, prefill=prefill_model)
            c0 = await cl.add("c0", C, decode=decode_model(fail_after=3))
            c1 = await cl.add("c1", C, decode=decode_model())
            out = await cl.generate(request_id="r1", max_tokens=MAX)
            assert ids(out) == [tok(i) for i in range(MAX)]  # no repeat, no gap
            assert "".join(r.text for r in out) == "".join(f"<{i}>" for i in range(MAX))
            last = out[-1]
            assert last.finish_reason == LENGTH and not last.error
            assert last.usage.completion_tokens == MAX
            assert (last.timing.producer, last.timing.consumer) == ("p0", "c1")
            # the new legs resume after exactly what the client had: token 0 and 3 more
            prior = [tok(i) for i in range(4)]
            assert [list(r.prior_output_ids) for r in p.prefill_requests] == [[], prior]
            assert [r.request_id for r in p.prefill_requests] == ["r1", "r1#retry1"]
            (d1,) = c1.decode_requests
            assert list(d1.prior_output_ids) == prior and d1.request_id == "r1#retry1"
            assert d1.seed == c0.decode_requests[0].seed
            await wait_until(lambda: c0.aborts == ["r1"])
            assert metric(cl, "pdserve_router_migrations_total") == 1.0
            assert metric(cl, "pdserve_router_prefill_retries_total") == 0.0
            assert cl.server.registry is not None
            assert all(w.inflight == 0 for w in cl.server.registry.all())

    run(main())


@pytest.mark.parametrize("how", ["kill", "eof"])
def test_killed_consumer_and_early_end_migrate_too(how: str) -> None:
    async def main() -> None:
        async with Cluster(policy="round_robin", heartbeat_timeout_s=HB) as cl:
            await cl.add("p0", P, prefill=prefill_model)
            await cl.add("c0", C, decode=decode_model(fail_after=2, how=how))
            c1 = await cl.add("c1", C, decode=decode_model())
            out = await cl.generate(request_id="r1", max_tokens=MAX)
            assert ids(out) == [tok(i) for i in range(MAX)]
            assert out[-1].finish_reason == LENGTH and not out[-1].error, out[-1].error
            assert list(c1.decode_requests[0].prior_output_ids) == [tok(i) for i in range(3)]

    run(main())


def test_colocated_worker_failing_migrates_to_a_colocated_worker() -> None:
    async def main() -> None:
        async with Cluster(policy="round_robin", heartbeat_timeout_s=HB) as cl:
            w0 = await cl.add("w0", CO, decode=decode_model(fail_after=5))
            w1 = await cl.add("w1", CO, decode=decode_model())
            out = await cl.generate(request_id="r1", max_tokens=MAX)
            assert ids(out) == [tok(i) for i in range(MAX)]
            assert out[-1].timing.colocated == "w1" and not out[-1].error
            assert list(w1.decode_requests[0].prior_output_ids) == [tok(i) for i in range(5)]
            assert w1.decode_requests[0].colocated
            await wait_until(lambda: w0.aborts == ["r1"])

    run(main())


def test_failed_kv_transfer_after_token0_is_paired_with_another_consumer() -> None:
    """A consumer whose KV port cannot be reached: the producer reports the transfer
    failed; the client has token 0, the request goes on through the other consumer."""
    async def prefill(w: FakeWorker, req: Any, inputs: Any) -> Any:
        yield model_token0(req)
        await next_destination(w, inputs)
        dest = w.destinations[-1].consumer_id
        yield transfer(ok=dest != "c0", error="cannot reach consumer c0")

    async def main() -> None:
        async with Cluster(policy="round_robin", heartbeat_timeout_s=HB) as cl:
            p = await cl.add("p0", P, prefill=prefill)
            c0 = await cl.add("c0", C, decode=decode_model(fail_after=0, how="hang"))
            await cl.add("c1", C, decode=decode_model())
            out = await cl.generate(request_id="r1", max_tokens=MAX)
            assert ids(out) == [tok(i) for i in range(MAX)]
            assert not out[-1].error and out[-1].timing.consumer == "c1"
            assert [list(r.prior_output_ids) for r in p.prefill_requests] == [[], [tok(0)]]
            await wait_until(lambda: c0.aborts == ["r1"])  # its reservation freed

    run(main())


def test_migrations_are_bounded_then_a_clear_error() -> None:
    async def main() -> None:
        async with Cluster(policy="round_robin", max_migrations=1, heartbeat_timeout_s=HB) as cl:
            await cl.add("p0", P, prefill=prefill_model)
            cs = [await cl.add(f"c{i}", C, decode=decode_model(fail_after=1)) for i in range(3)]
            out = await cl.generate(request_id="r1", max_tokens=MAX)
            assert out[-1].finish_reason == ERROR
            assert ids(out) == [tok(i) for i in range(4)]  # 0, 1 from one, 2 + 3 from another
            err = out[-1].error
            assert "consumer engine died" in err and "1 migration(s) of at most 1" in err, err
            served = [c.worker_id for c in cs if c.decode_requests]
            assert len(served) == 2 and all(len(c.decode_requests) <= 1 for c in cs)
            assert f"failed on: {', '.join(served)}" in err, err
            assert metric(cl, "pdserve_router_migrations_total") == 1.0

    run(main())


def test_no_migration_after_an_abort_or_with_nowhere_to_go() -> None:
    async def main() -> None:
        async with Cluster(heartbeat_timeout_s=HB) as cl:
            await cl.add("p0", P, prefill=prefill_model)
            await cl.add("c0", C, decode=decode_model(fail_after=2))
            out = await cl.generate(request_id="r1", max_tokens=MAX)
            assert out[-1].finish_reason == ERROR and ids(out) == [tok(i) for i in range(3)]
            assert "consumer engine died" in out[-1].error
            assert "migration" not in out[-1].error  # none happened
            assert metric(cl, "pdserve_router_migrations_total") == 0.0

    run(main())


def test_the_cli_flag_sets_the_bound_and_a_bad_one_names_it() -> None:
    p = argparse.ArgumentParser()
    add_router_parser(p.add_subparsers(dest="command"))
    assert router_config(p.parse_args(["router"])).max_migrations == 2
    assert router_config(p.parse_args(["router", "--max-migrations", "0"])).max_migrations == 0
    with pytest.raises(ValueError, match="^--max-migrations: must be >= 0"):
        RouterConfig(max_migrations=-1)


def test_a_restarted_worker_may_take_the_request_it_failed() -> None:
    """Only the failed registration is avoided: the same worker id registered again (a
    restart) is a new worker, so a 1P1C cluster recovers once it is back."""
    calls = 0
    inner = decode_model()

    async def decode(w: FakeWorker, req: Any) -> Any:
        nonlocal calls
        calls += 1
        if calls > 1:
            async for out in inner(w, req):
                yield out
            return
        yield reserved()
        for i in (1, 2):
            yield tokens([tok(i)], f"<{i}>")
            await asyncio.sleep(0.01)
        await w.register()  # "restarted": the router drops the old registration
        await asyncio.sleep(3600)

    async def main() -> None:
        async with Cluster(heartbeat_timeout_s=HB) as cl:
            await cl.add("p0", P, prefill=prefill_model)
            c0 = await cl.add("c0", C, decode=decode)
            out = await cl.generate(request_id="r1", max_tokens=MAX)
            assert ids(out) == [tok(i) for i in range(MAX)]
            assert not out[-1].error and out[-1].timing.consumer == "c0"
            assert [list(r.prior_output_ids) for r in c0.decode_requests] == [
                [], [tok(i) for i in range(3)]]

    run(main())
