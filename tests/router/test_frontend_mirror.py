"""A mirror frontend's registry follows the primary's views (router/control/frontends.py)."""

from __future__ import annotations

import asyncio

import grpc
from pdserve.v1 import common_pb2, router_pb2

from router.control.frontends import PrimaryMembership, RegistryMirror
from router.control.registry import CONSUMER, PRODUCER, Registry


def view(*workers: tuple[str, int, int, bool]) -> router_pb2.RegistryView:
    out = router_pb2.RegistryView()
    for wid, role, inc, draining in workers:
        out.workers.add(worker_id=wid, role=role, address=f"{wid}:1",  # type: ignore[arg-type]
                        kv_address="kv" if role == CONSUMER else "", model="m",
                        kv_fingerprint="fp", max_model_len=64, incarnation=inc,
                        draining=draining, drain_reason="SIGTERM" if draining else "",
                        load=common_pb2.WorkerLoad(waiting=inc))
    return out


def test_views_add_update_replace_and_remove_workers() -> None:
    async def main() -> None:
        reg = Registry(heartbeat_timeout_s=3.0)
        dropped: list[str] = []
        reg.on_drop.append(lambda w, why: dropped.append(f"{w.worker_id}: {why}"))
        mirror = RegistryMirror(reg, grpc.aio.insecure_channel("127.0.0.1:1"), "")
        mirror.apply(view(("p0", PRODUCER, 1, False), ("c0", CONSUMER, 2, False)))
        assert sorted(w.worker_id for w in reg.all()) == ["c0", "p0"]
        first = reg.get("p0")
        mirror.apply(view(("p0", PRODUCER, 1, True), ("c0", CONSUMER, 2, False)))
        assert reg.get("p0") is first and first.draining and first.drain_reason == "SIGTERM"
        # re-registered on the primary: a new worker here too (its old requests fail over)
        mirror.apply(view(("p0", PRODUCER, 7, False), ("c0", CONSUMER, 2, False)))
        assert reg.get("p0") is not first and reg.get("p0").load.waiting == 7
        assert dropped == ["p0: worker p0 re-registered"]
        mirror.apply(view(("p0", PRODUCER, 7, False)))
        assert reg.get("c0") is None and dropped[-1].startswith("c0: worker c0 left")
        assert mirror.views == 4

    asyncio.run(main())


def test_the_primary_numbers_each_registration() -> None:
    async def main() -> None:
        reg = Registry(heartbeat_timeout_s=3.0)
        m = PrimaryMembership(reg, "")
        reg.register(worker_id="p0", role=PRODUCER, address="a:1", max_model_len=64)
        a = m.view().workers[0].incarnation
        assert m.view().workers[0].incarnation == a  # stable while the same registration
        reg.register(worker_id="p0", role=PRODUCER, address="a:1", max_model_len=64)
        assert m.view().workers[0].incarnation != a

    asyncio.run(main())


def test_a_mirror_knows_a_workers_tp_and_dp_sizes_and_outputs_port() -> None:
    async def main() -> None:
        primary = Registry(heartbeat_timeout_s=3.0)
        primary.register(worker_id="p0", role=PRODUCER, address="a:1", max_model_len=64,
                         tp_size=4, dp_size=2, outputs_address="a:2",
                         outputs_unix="@pdserve-outputs-ab")
        reg = Registry(heartbeat_timeout_s=3.0)
        mirror = RegistryMirror(reg, grpc.aio.insecure_channel("127.0.0.1:1"), "")
        mirror.apply(PrimaryMembership(primary, "").view())
        w = reg.get("p0")
        assert w is not None and (w.tp_size, w.dp_size) == (4, 2)
        assert w.outputs_address == "a:2"  # every frontend reads the worker's plain port
        assert w.outputs_unix == "@pdserve-outputs-ab"  # (frontends share the router's host)

    asyncio.run(main())
