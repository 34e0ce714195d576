"""Liveness that load cannot fake, on the router's side.

A router whose own loop stalled keeps every worker (the heartbeats it could not process are
no worker's fault); a worker that reports itself behind (its event loop or its engine) is
busy: it gets no new requests, keeps those it runs, and is never dropped for it; when every
worker that could take a request is busy, new requests are refused with RESOURCE_EXHAUSTED
(HTTP 429) and a retry hint; a worker that truly goes silent is still dropped.
"""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest
from pdserve.v1 import common_pb2, router_pb2
from router_fakes import CO, Cluster, read_all, request, run, tokens, wait_until

from router.control.policy import LeastLoaded, RoundRobin, place
from router.control.registry import COLOCATED, CONSUMER, PRODUCER, Registry, WorkerInfo
from router.http.http_errors import from_request_error
from router.requests.dispatcher import busy_message
from router.requests.errors import Overloaded


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def add(reg: Registry, wid: str, role: int, **load: float) -> WorkerInfo:
    return reg.register(worker_id=wid, role=role, address=f"{wid}:1", kv_address="kv",
                        model="m", kv_fingerprint="fp", max_model_len=2048,
                        load=common_pb2.WorkerLoad(kv_blocks_free=100, kv_blocks_total=100,
                                                   **load))  # type: ignore[arg-type]


def beat(reg: Registry, wid: str, **load: float) -> bool:
    return reg.heartbeat(wid, common_pb2.WorkerLoad(kv_blocks_free=100, kv_blocks_total=100,
                                                    **load))  # type: ignore[arg-type]


# -- the router's own loop stalls ----------------------------------------------------------

def test_a_router_loop_stall_drops_no_worker() -> None:
    clock = Clock()
    reg = Registry(heartbeat_timeout_s=3.0, clock=clock)
    dropped: list[str] = []
    reg.on_drop.append(lambda w, why: dropped.append(why))
    period = 0.5
    reg.tick(period)
    p, c = add(reg, "p0", PRODUCER), add(reg, "c0", CONSUMER)
    for _ in range(2):  # a healthy loop: on-time ticks, heartbeats every second
        clock.t += period
        reg.tick(period)
        assert reg.sweep() == []
    beat(reg, "p0"), beat(reg, "c0")
    # The loop stalls 4 s (a long prompt tokenized on it, a GC pause, the host starved):
    # nothing ran, no heartbeat was processed. Right after it, the queued heartbeats and
    # the overdue sweep tick run in either order; neither may find a worker expired.
    clock.t += 4.0
    assert reg.usable(PRODUCER) == [p] and reg.usable(CONSUMER) == [c]  # before the tick
    assert beat(reg, "p0")  # a heartbeat before the tick: known (old code: expired)
    assert reg.tick(period) == pytest.approx(3.5)  # 4 s since the last tick, meant 0.5
    assert reg.sweep() == []  # c0's heartbeat comes after the tick: still within its time
    assert beat(reg, "c0")
    assert reg.get("p0") is p and reg.get("c0") is c  # the same registrations
    assert dropped == []
    assert reg.stall_credit_s == pytest.approx(3.5)


def test_a_silent_worker_is_still_dropped_stall_or_not() -> None:
    clock = Clock()
    reg = Registry(heartbeat_timeout_s=3.0, clock=clock)
    dropped: list[str] = []
    reg.on_drop.append(lambda w, why: dropped.append(why))
    period = 0.5
    reg.tick(period)
    add(reg, "p0", PRODUCER)
    add(reg, "c0", CONSUMER)  # goes silent now (SIGSTOP): only p0 heartbeats

    def tick_for(seconds: float) -> float:
        """On-time ticks with p0 heartbeating; the time c0 was dropped at, or 0."""
        for _ in range(round(seconds / period)):
            clock.t += period
            beat(reg, "p0")
            reg.tick(period)
            if reg.sweep():
                return clock.t
        return 0.0

    start = clock.t
    assert tick_for(2.0) == 0.0
    clock.t += 2.0  # a 2 s router stall: credited, so it delays the verdict by as much
    reg.tick(period)
    beat(reg, "p0")
    assert reg.sweep() == []
    when = tick_for(5.0)
    assert when, "a silent worker must still be dropped"
    # dropped once silent over 3 s of the router's own time: 2 s before the stall, the
    # stall's 0.5 s that was not credited (its tick was due then), then 1 s more
    assert when - start == pytest.approx(2.0 + 2.0 + 1.0)
    assert [w.worker_id for w in reg.all()] == ["p0"]
    assert len(dropped) == 1 and "c0" in dropped[0] and "stopped heartbeating" in dropped[0]


# -- busy workers ----------------------------------------------------------------------------

def test_a_busy_worker_gets_no_new_requests_and_is_never_dropped() -> None:
    clock = Clock()
    reg = Registry(heartbeat_timeout_s=3.0, clock=clock, busy_lag_s=2.0, busy_engine_s=2.0)
    add(reg, "p0", PRODUCER)
    add(reg, "c0", CONSUMER)
    c1 = add(reg, "c1", CONSUMER)
    beat(reg, "c0", loop_lag_s=4.5)  # its gRPC process's loop is 4.5 s behind
    assert reg.busy() == [reg.get("c0")]
    c0 = reg.get("c0")
    assert c0 is not None and reg.busy_reason(c0) == "its event loop is 4.5 s behind " \
        "(--busy-lag 2 s)"
    for policy in (RoundRobin(), LeastLoaded()):
        for _ in range(6):
            slot = place(reg, policy)
            assert slot is not None and slot.consumer is c1
    # least loaded would pick c0 (c1 is loaded), but c0 is busy
    beat(reg, "c1", running=50)
    assert place(reg, LeastLoaded()).consumer is c1  # type: ignore[union-attr]
    # an engine whose reports stopped coming is busy too
    beat(reg, "c1", engine_report_age_s=3.0)
    assert reg.busy_reason(c1) == \
        "its engine's last load report is 3.0 s old (--busy-engine-age 2 s)"
    assert place(reg, RoundRobin()) is None  # no consumer keeps up
    assert place(reg, RoundRobin(), busy_ok=True) is not None  # a running request may go
    assert reg.serving()  # alive: health stays SERVING (this is load, not an outage)
    for _ in range(10):  # busy for 10 s, heartbeating: never dropped
        clock.t += 1.0
        beat(reg, "p0"), beat(reg, "c0", loop_lag_s=5.0), beat(reg, "c1", loop_lag_s=5.0)
        assert reg.sweep() == []
    beat(reg, "c0", loop_lag_s=0.1)  # caught up
    assert reg.busy() == [reg.get("c1")]
    assert place(reg, RoundRobin()).consumer is reg.get("c0")  # type: ignore[union-attr]


def test_zero_bounds_turn_busy_off() -> None:
    reg = Registry(heartbeat_timeout_s=3.0, busy_lag_s=0.0, busy_engine_s=0.0)
    add(reg, "co0", COLOCATED, loop_lag_s=100.0, engine_report_age_s=100.0)
    assert reg.busy() == [] and place(reg, RoundRobin()) is not None


def test_all_busy_is_resource_exhausted_with_a_retry_hint() -> None:
    """Real router, scripted workers: the busy consumer is reported in the heartbeats."""
    async def main() -> None:
        async with Cluster(busy_lag_s=1.0, retry_after_s=2.0) as cl:
            p, c = await cl.pd()
            assert (await cl.generate(max_tokens=3))[-1].finish_reason  # serving
            c.load = common_pb2.WorkerLoad(kv_blocks_free=100, kv_blocks_total=100,
                                           loop_lag_s=3.5)
            reg = cl.server.registry
            assert reg is not None
            c0 = reg.get("c0")
            await wait_until(lambda: bool(reg.busy()))
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await cl.generate(max_tokens=3)
            err = e.value
            assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, err
            assert err.details() == ("all 1 consumer is busy: c0: its event loop is 3.5 s "
                                     "behind (--busy-lag 1 s); retry after 2 s"), err
            assert ("retry-after", "2") in tuple(err.trailing_metadata() or ())
            # busy for many heartbeat timeouts (0.5 s): kept, the same registration
            await asyncio.sleep(1.5)
            assert reg.get("c0") is c0
            status = await cl.router.ClusterStatus(router_pb2.ClusterStatusRequest())
            shown = {w.worker_id: w.load.loop_lag_s for w in status.workers}
            assert shown["c0"] == pytest.approx(3.5)
            assert b'pdserve_worker_busy{role="consumer",worker="c0"} 1.0' in \
                cl.server.metrics.render()  # type: ignore[union-attr]
            c.load = common_pb2.WorkerLoad(kv_blocks_free=100, kv_blocks_total=100)
            await wait_until(lambda: not reg.busy())
            assert (await cl.generate(max_tokens=3))[-1].error == ""
            assert reg.get("c0") is c0

    run(main())


def test_all_busy_is_http_429_with_retry_after() -> None:
    reg = Registry(heartbeat_timeout_s=3.0, busy_lag_s=2.0, busy_engine_s=5.0)
    add(reg, "co0", CO, loop_lag_s=2.5)
    add(reg, "co1", CO, engine_report_age_s=9.0)
    msg = busy_message(reg, 1.0)
    assert msg == ("all 2 colocated workers are busy: co0: its event loop is 2.5 s behind "
                   "(--busy-lag 2 s); co1: its engine's last load report is 9.0 s old "
                   "(--busy-engine-age 5 s); retry after 1 s")
    http = from_request_error(Overloaded(msg, 1.0), chat=False)
    assert http.status == 429 and http.headers == {"Retry-After": "1"}


def test_a_busy_worker_keeps_its_running_requests() -> None:
    """Busy mid-stream: the stream goes on to its end on the same worker."""
    async def slow_decode(w, req):  # type: ignore[no-untyped-def]
        yield tokens([TOKEN], "A", first_step_ns=time.time_ns())
        for _ in range(10):
            await asyncio.sleep(0.1)
            yield tokens([TOKEN], "A")
        yield tokens([TOKEN], "A", common_pb2.FINISH_REASON_LENGTH)

    async def main() -> None:
        async with Cluster(busy_lag_s=1.0) as cl:
            w = await cl.add("co0", CO, decode=slow_decode)
            reg = cl.server.registry
            assert reg is not None
            call = cl.router.Generate(request(max_tokens=12))
            first = await call.read()
            assert first.token_ids == [TOKEN]
            w.load = common_pb2.WorkerLoad(kv_blocks_free=100, kv_blocks_total=100,
                                           loop_lag_s=5.0)
            await wait_until(lambda: bool(reg.busy()))
            rest = await read_all(call)
            assert rest[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH
            assert rest[-1].error == ""
            assert sum(len(r.token_ids) for r in [first, *rest]) == 12
            assert len(w.decode_requests) == 1  # never moved

    run(main())


TOKEN = 77


# -- the router's loop stalls, end to end -----------------------------------------------------

def test_a_stalled_router_loop_fails_no_request_and_drops_no_worker() -> None:
    """Real router and scripted workers in one loop, which stalls 2.5 s (5x the heartbeat
    timeout) mid-stream. Before, the overdue sweep (or the heartbeat's own expiry check)
    found every worker silent past the timeout after the stall and dropped them: the
    request failed or migrated."""
    async def slow_decode(w, req):  # type: ignore[no-untyped-def]
        yield tokens([TOKEN], "A", first_step_ns=time.time_ns())
        for _ in range(6):
            await asyncio.sleep(0.1)
            yield tokens([TOKEN], "A")
        yield tokens([TOKEN], "A", common_pb2.FINISH_REASON_LENGTH)

    async def main() -> None:
        async with Cluster(heartbeat_interval_s=0.1, heartbeat_timeout_s=0.5) as cl:
            await cl.add("co0", CO, decode=slow_decode)
            reg = cl.server.registry
            assert reg is not None
            dropped: list[str] = []
            reg.on_drop.append(lambda w, why: dropped.append(why))
            co0 = reg.get("co0")
            call = cl.router.Generate(request(max_tokens=8))
            assert (await call.read()).token_ids == [TOKEN]
            time.sleep(2.5)  # the router's loop (and everything on it) stalls
            rest = await read_all(call)
            assert rest[-1].error == "" and rest[-1].finish_reason == \
                common_pb2.FINISH_REASON_LENGTH
            await asyncio.sleep(1.0)  # heartbeats resume: nothing is dropped later either
            assert dropped == [] and reg.get("co0") is co0
            assert cl.server.dispatcher.migrations == 0  # type: ignore[union-attr]
            assert reg.stall_credit_s > 2.0

    run(main())


@pytest.mark.parametrize("value", [-1.0, float("nan"), float("inf")])
@pytest.mark.parametrize("field,flag", [("busy_lag_s", "--busy-lag"),
                                        ("busy_engine_s", "--busy-engine-age")])
def test_a_bad_busy_bound_is_refused_naming_the_flag(value: float, field: str,
                                                     flag: str) -> None:
    from router.config import RouterConfig

    with pytest.raises(ValueError, match=rf"^{flag}: must be a number of seconds >= 0"):
        RouterConfig(**{field: value})  # type: ignore[arg-type]
    assert getattr(RouterConfig(**{field: 0.0}), field) == 0.0  # type: ignore[arg-type]


def test_the_router_command_passes_the_busy_bounds() -> None:
    import argparse

    from deploy.router_cmd import add_router_parser, router_config

    ap = argparse.ArgumentParser()
    add_router_parser(ap.add_subparsers())
    default = router_config(ap.parse_args(["router"]))
    assert (default.busy_lag_s, default.busy_engine_s) == (2.0, 10.0)
    cfg = router_config(ap.parse_args(["router", "--busy-lag", "0.5", "--busy-engine-age", "0"]))
    assert (cfg.busy_lag_s, cfg.busy_engine_s) == (0.5, 0.0)
