"""Registry bookkeeping and the pairing policies on hand-made loads (no gRPC)."""

from __future__ import annotations

import random

import pytest
from pdserve.v1 import common_pb2

from router.control.policy import (
    CONSUMER_POOL,
    ENTRY_POOL,
    LeastLoaded,
    PowerOfTwo,
    RoundRobin,
    load_score,
    make_policy,
    place,
)
from router.control.registry import (
    COLOCATED,
    CONSUMER,
    PRODUCER,
    RegistrationError,
    Registry,
    WorkerInfo,
)


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def load(waiting: int = 0, running: int = 0, free: int = 100, total: int = 100,
         orphans: bool = False) -> common_pb2.WorkerLoad:
    return common_pb2.WorkerLoad(waiting=waiting, running=running, kv_blocks_free=free,
                                 kv_blocks_total=total, kv_exhausted_by_orphans=orphans)


def add(reg: Registry, wid: str, role: int, fp: str = "fp", mml: int = 2048,
        **kw: object) -> WorkerInfo:
    return reg.register(worker_id=wid, role=role, address=f"{wid}:1", kv_address="kv",
                        model="m", kv_fingerprint=fp, max_model_len=mml, load=load(**kw))  # type: ignore[arg-type]


def worker(wid: str, role: int = PRODUCER, **kw: object) -> WorkerInfo:
    return WorkerInfo(worker_id=wid, role=role, address="a", kv_address="", model="m",
                      kv_fingerprint="fp", max_model_len=1, load=load(**kw),  # type: ignore[arg-type]
                      last_heartbeat=0.0)


# -- registry ------------------------------------------------------------------------------

def test_heartbeat_keeps_worker_and_silence_drops_it() -> None:
    clock = Clock()
    reg = Registry(heartbeat_timeout_s=3.0, clock=clock)
    dropped: list[str] = []
    reg.on_drop.append(lambda w, why: dropped.append(f"{w.worker_id}: {why}"))
    add(reg, "p0", PRODUCER)
    add(reg, "c0", CONSUMER)
    assert reg.serving()
    for _ in range(5):  # heartbeats every second keep both for longer than the timeout
        clock.t += 1.0
        assert reg.heartbeat("p0", load()) and reg.heartbeat("c0", load())
        assert reg.sweep() == []
    clock.t += 2.0
    assert reg.heartbeat("p0", load())
    clock.t += 1.5  # c0 silent for 3.5 s
    assert [w.worker_id for w in reg.sweep()] == ["c0"]
    assert "stopped heartbeating" in dropped[0] and dropped[0].startswith("c0")
    assert not reg.serving() and reg.get("c0") is None
    assert not reg.heartbeat("c0", load())  # known=false: it must register again
    add(reg, "c0", CONSUMER)
    assert reg.serving()


def test_expired_worker_is_not_usable_before_the_sweep() -> None:
    clock = Clock()
    reg = Registry(heartbeat_timeout_s=3.0, clock=clock)
    add(reg, "w0", COLOCATED)
    clock.t += 3.1
    assert reg.usable(COLOCATED) == [] and not reg.serving()
    assert not reg.heartbeat("w0", load())


def test_orphan_exhausted_worker_is_unhealthy() -> None:
    reg = Registry(heartbeat_timeout_s=3.0, clock=Clock())
    add(reg, "p0", PRODUCER)
    add(reg, "c0", CONSUMER)
    changes: list[int] = []
    reg.on_change.append(lambda: changes.append(1))
    assert reg.heartbeat("c0", load(orphans=True))
    c0 = reg.get("c0")
    assert c0 is not None and not c0.healthy and "orphan" in c0.unhealthy_reason
    assert reg.usable(CONSUMER) == [] and not reg.serving() and changes
    reg.heartbeat("c0", load())
    assert reg.serving()


def test_pool_rules_and_max_model_len() -> None:
    reg = Registry(heartbeat_timeout_s=3.0, clock=Clock())
    add(reg, "p0", PRODUCER, mml=4096)
    assert not reg.serving()  # a producer alone cannot serve
    add(reg, "c0", CONSUMER, mml=2048)
    assert reg.serving() and reg.max_model_len() == 2048
    reg.remove("p0", "test")
    add(reg, "w0", COLOCATED, mml=1024)
    assert reg.serving() and reg.max_model_len() == 1024


def test_fingerprint_mismatch_is_refused_but_colocated_may_differ() -> None:
    reg = Registry(heartbeat_timeout_s=3.0, clock=Clock())
    add(reg, "p0", PRODUCER, fp="A")
    with pytest.raises(RegistrationError, match=r"^kv_fingerprint: consumer c0 has 'B'.*p0") as e:
        add(reg, "c0", CONSUMER, fp="B")
    assert e.value.precondition
    add(reg, "w0", COLOCATED, fp="B")
    add(reg, "p0", PRODUCER, fp="C")  # re-registering the only P/D worker may change it


@pytest.mark.parametrize("kw,field", [
    (dict(worker_id=""), "worker_id"), (dict(role=0), "role"), (dict(address=""), "address"),
    (dict(kv_address=""), "kv_address"), (dict(max_model_len=0), "max_model_len"),
    (dict(model="other"), "model"), (dict(outputs_address="nohost"), "outputs_address"),
    (dict(outputs_address="h:0"), "outputs_address"),
    (dict(outputs_address="h:99999"), "outputs_address"),
    (dict(outputs_address=":5"), "outputs_address"),
    (dict(outputs_unix="pdserve-outputs-ab"), "outputs_unix"),  # no "@": a path, not a name
    (dict(outputs_unix="@"), "outputs_unix"), (dict(outputs_unix="@a b"), "outputs_unix"),
    (dict(outputs_unix="@a\nb"), "outputs_unix"),
    (dict(outputs_unix="@" + "x" * 108), "outputs_unix"),
])
def test_bad_registration_names_the_field(kw: dict[str, object], field: str) -> None:
    reg = Registry(heartbeat_timeout_s=3.0, served_model="m", clock=Clock())
    args: dict[str, object] = dict(worker_id="c0", role=CONSUMER, address="a:1", kv_address="kv",
                                   model="m", kv_fingerprint="fp", max_model_len=10)
    args.update(kw)
    with pytest.raises(RegistrationError, match=f"^{field}:"):
        reg.register(**args)  # type: ignore[arg-type]


# -- policies ------------------------------------------------------------------------------

def test_load_score_counts_queue_and_kv_use() -> None:
    assert load_score(worker("a")) == 0
    assert load_score(worker("a", waiting=2, running=1)) == 3
    assert load_score(worker("a", free=50, total=100)) == pytest.approx(2.0)
    w = worker("a", running=1)
    w.inflight = 5  # the router's own count wins over a stale report
    assert load_score(w) == 5


def test_round_robin_cycles_per_pool() -> None:
    rr = RoundRobin()
    ws = [worker("a"), worker("b"), worker("c")]
    assert [rr.choose(ENTRY_POOL, ws).worker_id for _ in range(4)] == ["a", "b", "c", "a"]
    assert rr.choose(CONSUMER_POOL, ws).worker_id == "a"  # its own counter


def test_least_loaded_prefers_short_queue_then_free_kv() -> None:
    ll = LeastLoaded()
    busy, idle = worker("a", waiting=3), worker("b")
    assert ll.choose(ENTRY_POOL, [busy, idle]) is idle
    full_kv, queued = worker("a", free=0, total=100), worker("b", waiting=1)
    assert ll.choose(ENTRY_POOL, [full_kv, queued]) is queued
    x, y = worker("x"), worker("y")
    x.dispatched = 3  # a tie goes to the worker given fewer requests
    assert ll.choose(ENTRY_POOL, [x, y]) is y


def test_power_of_two_takes_the_less_loaded_of_two_random() -> None:
    p2 = PowerOfTwo(random.Random(0))
    heavy, light = worker("a", waiting=9), worker("b")
    assert all(p2.choose(ENTRY_POOL, [heavy, light]) is light for _ in range(20))
    ws = [worker(str(i), waiting=i) for i in range(8)]
    picks = [p2.choose(ENTRY_POOL, ws) for _ in range(200)]
    assert all(p is not ws[-1] for p in picks)  # the most loaded never wins a pair
    assert len({p.worker_id for p in picks}) > 3  # yet the choice is spread
    assert p2.choose(ENTRY_POOL, [heavy]) is heavy


def test_make_policy_names_the_flag() -> None:
    assert make_policy("power_of_two").name == "power_of_two"
    with pytest.raises(ValueError, match="^--policy:"):
        make_policy("random")


def test_place_pairs_producers_with_consumers_and_colocated_alone() -> None:
    reg = Registry(heartbeat_timeout_s=3.0, clock=Clock())
    rr = RoundRobin()
    assert place(reg, rr) is None
    add(reg, "p0", PRODUCER)
    assert place(reg, rr) is None  # no consumer: producers are not an entry
    add(reg, "w0", COLOCATED)
    slot = place(reg, rr)
    assert slot is not None and slot.colocated is not None and slot.producer is None
    add(reg, "c0", CONSUMER)
    slots = [place(reg, rr) for _ in range(4)]
    pairs = [s for s in slots if s is not None and s.producer is not None]
    assert len(pairs) == 2 and all(s.consumer and s.consumer.worker_id == "c0" for s in pairs)
    ll = LeastLoaded()
    reg.heartbeat("w0", load(waiting=5))
    for _ in range(3):
        s = place(reg, ll)
        assert s is not None and s.producer is not None
