"""Draining workers and role changes in the router: registry bookkeeping and split plans
(no gRPC), then the Membership and Admin services against scripted workers."""

from __future__ import annotations

import asyncio
from unittest.mock import patch

import grpc
import pytest
from pdserve.v1 import common_pb2, router_pb2, router_pb2_grpc, worker_pb2
from router_fakes import CO, C, Cluster, P, run

from router.control.policy import RoundRobin, place
from router.control.registry import COLOCATED, CONSUMER, PRODUCER, Registry, WorkerInfo
from router.control.role_change import SplitError, Step, order_steps, plan_split
from router.requests.health import wait_until_serving


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def add(reg: Registry, wid: str, role: int) -> WorkerInfo:
    return reg.register(worker_id=wid, role=role, address=f"{wid}:1", kv_address="kv",
                        model="m", kv_fingerprint="fp", max_model_len=2048, version="0.1.0")


# -- registry ------------------------------------------------------------------------------

def test_a_draining_worker_is_listed_heartbeating_but_never_picked() -> None:
    clock = Clock()
    reg = Registry(heartbeat_timeout_s=3, clock=clock)
    dropped: list[str] = []
    reg.on_drop.append(lambda w, why: dropped.append(w.worker_id))
    p0, p1, c0 = add(reg, "p0", PRODUCER), add(reg, "p1", PRODUCER), add(reg, "c0", CONSUMER)
    assert reg.drain("p0", "SIGTERM") and not reg.drain("nobody", "x")
    assert p0.draining and p0.drain_reason == "SIGTERM" and p0.version == "0.1.0"
    assert reg.usable(PRODUCER) == [p1] and reg.serving()
    policy = RoundRobin()
    assert all(place(reg, policy).producer is p1 for _ in range(6))  # type: ignore[union-attr]
    clock.t += 2
    assert reg.heartbeat("p0", None)  # still known: its in-flight requests go on
    assert reg.get("p0") is p0 and dropped == []  # no drop: nothing in flight is failed
    reg.drain("c0", "SIGTERM")
    assert not reg.serving()  # p1 has no consumer left
    # it left (Deregister done) with a request still running here: its last messages may
    # trail the call, so it stays until that request ends (then the sweep forgets it)
    p0.inflight = 1
    assert reg.leave("p0", "SIGTERM, drained") and not reg.leave("nobody", "x")
    assert reg.get("p0") is p0 and dropped == []
    reg.sweep()
    assert reg.get("p0") is p0
    p0.inflight = 0
    reg.sweep()
    assert dropped == ["p0"] and reg.get("p0") is None
    assert reg.leave("p1", "SIGTERM") and reg.get("p1") is None  # nothing running: at once
    # a restart under the same id is a new incarnation, not draining
    c0b = add(reg, "c0", CONSUMER)
    add(reg, "p1", PRODUCER)
    assert c0b is not c0 and not c0b.draining and reg.serving()


def test_a_worker_that_left_and_went_silent_is_not_reported_as_lost() -> None:
    """A worker that deregistered with a request still open here, then stopped
    heartbeating (its process exited), is dropped saying it left, not as a lost worker;
    a worker that never left still reads as one."""
    clock = Clock()
    reg = Registry(heartbeat_timeout_s=3, clock=clock)
    why: dict[str, str] = {}
    reg.on_drop.append(lambda w, reason: why.__setitem__(w.worker_id, reason))
    p0, p1 = add(reg, "p0", PRODUCER), add(reg, "p1", PRODUCER)
    p0.inflight = 1
    assert reg.leave("p0", "SIGTERM, drained")
    clock.t += 3.5
    assert {w.worker_id for w in reg.sweep()} == {"p0", "p1"}
    assert why["p0"] == ("worker p0 (producer at p0:1) left (SIGTERM, drained) and went "
                         "silent with 1 request(s) still open here")
    assert why["p1"] == "worker p1 (producer at p1:1) stopped heartbeating (3 s)"
    assert why["p1"].endswith(reg.silence_reason(p1))


def test_a_role_change_order_drains_and_is_read_by_orders() -> None:
    reg = Registry(heartbeat_timeout_s=3)
    add(reg, "x0", COLOCATED)
    assert reg.orders("x0") == 0 and reg.orders("nobody") == 0
    w = reg.order_role_change("x0", PRODUCER)
    assert w.draining and w.target_role == PRODUCER and reg.orders("x0") == PRODUCER
    assert reg.usable(COLOCATED) == []
    back = add(reg, "x0", PRODUCER)  # it registers again in its new role
    assert back.target_role == 0 and reg.orders("x0") == 0 and not back.draining


# -- split plans ---------------------------------------------------------------------------

def test_plan_moves_the_fewest_workers_least_busy_first() -> None:
    reg = Registry(heartbeat_timeout_s=3)
    for wid, role in (("p0", PRODUCER), ("p1", PRODUCER), ("c0", CONSUMER)):
        add(reg, wid, role)
    reg.get("p0").inflight = 5  # type: ignore[union-attr]
    assert plan_split(reg, 1, 2, 0) == [Step("p1", PRODUCER, CONSUMER)]
    assert plan_split(reg, 2, 1, 0) == []
    with pytest.raises(SplitError, match=r"^producers \+ consumers \+ colocated: .* 3 "):
        plan_split(reg, 1, 1, 0)
    with pytest.raises(SplitError, match="^producers/consumers: "):
        plan_split(reg, 3, 0, 0)
    reg.drain("p1", "SIGTERM")  # leaving: not part of any split
    # either step leaves no pair while it runs and a colocated worker after: plan order
    assert plan_split(reg, 0, 0, 2) == [Step("p0", PRODUCER, COLOCATED),
                                        Step("c0", CONSUMER, COLOCATED)]


def test_steps_are_ordered_to_keep_the_cluster_serving() -> None:
    # 2 colocated -> 1P1D: the first change must leave the other colocated serving; the
    # second unavoidably leaves a lone producer (requests are held meanwhile)
    steps = [Step("a", COLOCATED, PRODUCER), Step("b", COLOCATED, CONSUMER)]
    assert order_steps({"a": COLOCATED, "b": COLOCATED}, steps) == steps
    assert order_steps({"a": COLOCATED, "b": COLOCATED}, steps[::-1]) == steps[::-1]
    # 2P1D -> 1P1D + 1 colocated through these two steps: c0 first would leave no consumer
    # while it rebuilds; p1 first keeps p0 + c0 serving, and then p1 (a consumer) covers c0
    roles = {"p0": PRODUCER, "p1": PRODUCER, "c0": CONSUMER}
    plan = order_steps(roles, [Step("c0", CONSUMER, COLOCATED),
                               Step("p1", PRODUCER, CONSUMER)])
    assert [s.worker_id for s in plan] == ["p1", "c0"]


def test_requests_wait_for_a_role_change_only() -> None:
    async def body() -> None:
        clock = Clock()
        reg = Registry(heartbeat_timeout_s=30, clock=clock)
        add(reg, "p0", PRODUCER)
        assert not await wait_until_serving(reg)  # no change running: refused at once
        reg.hold_until = clock.t + 10
        waiter = asyncio.create_task(wait_until_serving(reg))
        await asyncio.sleep(0.05)
        assert not waiter.done()
        assert reg.held == 1
        with patch("router.requests.health.MAX_HELD", 1):  # bounded: one more is refused at once
            assert not await asyncio.wait_for(wait_until_serving(reg), 2)
        add(reg, "c0", CONSUMER)
        assert await asyncio.wait_for(waiter, 2)
        assert reg.held == 0
        reg.drain("c0", "x")
        clock.t += 11  # the change's deadline passed: refused
        assert not await asyncio.wait_for(wait_until_serving(reg), 2)

    run(body())


# -- services ------------------------------------------------------------------------------

def test_deregister_stops_new_work_and_done_forgets_the_worker() -> None:
    async def body() -> None:
        async with Cluster(cluster_token="tok", policy="round_robin") as cl:
            p0 = await cl.add("p0", P)
            p1 = await cl.add("p1", P)
            await cl.add("c0", C)
            mem = router_pb2_grpc.MembershipStub(cl.channel)
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await mem.Deregister(router_pb2.DeregisterRequest(worker_id="p0",
                                                                   cluster_token="bad"))
            assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
            r = await mem.Deregister(router_pb2.DeregisterRequest(
                worker_id="p0", cluster_token="tok", reason="SIGTERM"))
            assert r.known
            st = await cl.router.ClusterStatus(router_pb2.ClusterStatusRequest())
            ws = {w.worker_id: w for w in st.workers}
            assert ws["p0"].draining and not ws["p1"].draining
            assert ws["c0"].kv_fingerprint == "fp1" and ws["c0"].kv_address
            for _ in range(4):
                await cl.generate(max_tokens=2, temperature=0)
            assert len(p0.prefill_requests) == 0 and len(p1.prefill_requests) == 4
            # a worker that said done exits: no heartbeat follows (the fake's would find p0
            # unknown and register it again, as a restarted worker does; the suite saw it)
            p0.stop_heartbeats()
            await mem.Deregister(router_pb2.DeregisterRequest(
                worker_id="p0", cluster_token="tok", done=True))
            st = await cl.router.ClusterStatus(router_pb2.ClusterStatusRequest())
            assert "p0" not in {w.worker_id for w in st.workers}
            r = await mem.Deregister(router_pb2.DeregisterRequest(worker_id="p0",
                                                                   cluster_token="tok"))
            assert not r.known

    run(body())


def test_change_split_orders_workers_and_waits_for_their_new_roles() -> None:
    async def body() -> None:
        async with Cluster(api_key="key") as cl:
            p0 = await cl.add("p0", P)
            c0 = await cl.add("c0", C)
            admin = router_pb2_grpc.AdminStub(cl.channel)
            md = (("authorization", "Bearer key"),)
            with pytest.raises(grpc.aio.AioRpcError) as e:  # guarded like the client API
                await admin.ChangeSplit(router_pb2.ChangeSplitRequest(colocated=2)).read()
            assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await admin.ChangeSplit(router_pb2.ChangeSplitRequest(colocated=3),
                                        metadata=md).read()
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "must add up to the 2 registered" in (e.value.details() or "")
            call = admin.ChangeSplit(router_pb2.ChangeSplitRequest(colocated=2), metadata=md)
            planned = [await call.read(), await call.read()]
            assert [m.state for m in planned] == ["planned", "planned"]
            mem = router_pb2_grpc.MembershipStub(cl.channel)
            for _ in range(2):
                msg = await call.read()
                assert msg.state == "draining"
                w = p0 if msg.worker_id == "p0" else c0
                orders = await mem.Orders(router_pb2.OrdersRequest(worker_id=w.worker_id))
                assert orders.change_role == common_pb2.ROLE_COLOCATED
                # the heartbeat's answer carries the same order (the worker's one call)
                hb = await w.registry.Heartbeat(worker_pb2.HeartbeatRequest(
                    worker_id=w.worker_id, load=w.load))
                assert hb.known and hb.change_role == common_pb2.ROLE_COLOCATED
                # a second change is refused while this one runs
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    await admin.ChangeSplit(router_pb2.ChangeSplitRequest(colocated=2),
                                            metadata=md).read()
                assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
                w.role = CO  # what the real worker does once drained and rebuilt
                await w.register()
                msg = await call.read()
                assert (msg.state, msg.worker_id) == ("registered", w.worker_id)
            last = await call.read()
            assert last.done and last.error == "" and last.state == "done"
            st = await cl.router.ClusterStatus(router_pb2.ClusterStatusRequest(), metadata=md)
            assert {w.role for w in st.workers} == {CO}

    run(body(), timeout=30)


def test_a_planned_rebuild_is_not_logged_as_a_lost_worker(
        caplog: pytest.LogCaptureFixture) -> None:
    """A worker changing role sends no heartbeat while it rebuilds (longer than the
    heartbeat timeout): the router logs that as planned, never "dropped ... no heartbeat",
    and the change completes."""
    caplog.set_level("INFO")

    async def body() -> None:
        async with Cluster() as cl:  # heartbeat timeout 0.5 s
            p0 = await cl.add("p0", P)
            await cl.add("c0", C)
            admin = router_pb2_grpc.AdminStub(cl.channel)
            call = admin.ChangeSplit(router_pb2.ChangeSplitRequest(
                producers=0, consumers=0, colocated=2, step_timeout_s=20))
            while (m := await call.read()).state != "draining":
                pass
            w = p0 if m.worker_id == "p0" else cl.workers[1]
            w.heartbeating = False  # drained; now rebuilding its engine: silent
            await asyncio.sleep(2.0)  # 4x the heartbeat timeout
            assert cl.server.registry is not None
            assert cl.server.registry.get(w.worker_id) is not None
            w.role = CO
            w.heartbeating = True
            await w.register()
            assert (await call.read()).state == "registered"
            other = cl.workers[1] if w is p0 else p0
            assert (await call.read()).state == "draining"
            other.role = CO
            await other.register()
            while not (m := await call.read()).done:
                pass
            assert m.state == "done", m

    run(body(), timeout=30)
    text = caplog.text
    assert "dropped" not in text and "stopped heartbeating" not in text, text
    assert "role change: p0 is rebuilding as a colocated worker: silent until it registers " \
        "again, as planned" in text
    assert "role change: p0 registered again, now a colocated worker (planned: p0: producer " \
        "-> colocated)" in text
    assert "no heartbeat" not in text


def test_change_split_fails_when_a_worker_does_not_come_back() -> None:
    async def body() -> None:
        async with Cluster() as cl:
            await cl.add("x0", CO)
            await cl.add("x1", CO)
            admin = router_pb2_grpc.AdminStub(cl.channel)
            msgs = [m async for m in admin.ChangeSplit(router_pb2.ChangeSplitRequest(
                producers=1, consumers=1, step_timeout_s=0.5))]
            assert msgs[-1].done and msgs[-1].state == "failed"
            assert "did not register as producer within 0.5 s" in msgs[-1].error
            assert cl.server.registry is not None and cl.server.registry.hold_until == 0.0

    run(body(), timeout=30)


def test_plan_apply_cli_reports_refusals_and_success(capsys: pytest.CaptureFixture[str]
                                                     ) -> None:
    from deploy.cli import main

    async def body() -> list[int]:
        async with Cluster(api_key="key") as cl:
            await cl.add("p0", P)
            await cl.add("c0", C)
            base = ["plan", "apply", "--router", cl.server.address]
            return [await asyncio.to_thread(main, [*base, *args]) for args in (
                ["--producers", "1", "--consumers", "1"],  # no key
                ["--producers", "2", "--consumers", "1", "--api-key", "key"],
                ["--producers", "1", "--consumers", "1", "--api-key", "key"],  # already so
            )]

    assert run(body(), timeout=30) == [1, 1, 0]
    out, err = capsys.readouterr()
    lines = err.splitlines()
    assert lines[0].startswith("pdserve: error: the router at ") and "refused the call: " \
        "authorization:" in lines[0] and lines[0].endswith("(pass its key with --api-key "
                                                            "or $PDSERVE_API_KEY)")
    assert lines[1].endswith("answered INVALID_ARGUMENT: producers + consumers + colocated: "
                             "must add up to the 2 registered worker(s) not draining, got 3")
    assert out.strip() == "role change done (0 step(s))"
