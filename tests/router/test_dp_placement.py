"""The router places a colocated request on the least loaded attention data-parallel group
of its worker, from the heartbeat's per-group load plus what it sent since."""

from __future__ import annotations

import pytest
from pdserve.v1 import common_pb2

from router.control.dp_placement import pick_dp_rank
from router.control.registry import COLOCATED, Registry


def _load(*groups: tuple[int, int, int]) -> common_pb2.WorkerLoad:
    return common_pb2.WorkerLoad(dp_ranks=[
        common_pb2.DPRankLoad(waiting=w, running=r, kv_blocks_free=f, kv_blocks_total=100)
        for w, r, f in groups])


def _worker(reg: Registry, load: common_pb2.WorkerLoad):  # type: ignore[no-untyped-def]
    return reg.register(worker_id="w", role=COLOCATED, address="w:1", kv_address="",
                        model="m", kv_fingerprint="fp", max_model_len=64, load=load,
                        tp_size=2)


def test_one_group_is_left_to_the_worker():
    reg = Registry(heartbeat_timeout_s=3.0)
    assert pick_dp_rank(_worker(reg, common_pb2.WorkerLoad(waiting=3))) is None


def test_least_loaded_group_then_what_was_sent_since_the_heartbeat():
    reg = Registry(heartbeat_timeout_s=3.0)
    w = _worker(reg, _load((0, 3, 50), (1, 0, 90)))
    # group 1 holds 1 request, group 0 holds 3: two go to 1; at equal depth, the one with
    # more free blocks (1) first, then they alternate
    assert [pick_dp_rank(w) for _ in range(6)] == [1, 1, 1, 0, 1, 0]
    # a heartbeat replaces the counts with the worker's own numbers
    assert reg.heartbeat("w", _load((2, 2, 50), (0, 4, 40)))
    assert w.dp_sent == []
    assert pick_dp_rank(w) == 0  # equal depth: the one with more free blocks
    assert pick_dp_rank(w) == 1


def test_a_consumer_pairs_with_one_attention_group_of_the_producer():
    from router.control.dp_placement import attention_tp
    from router.control.registry import CONSUMER, PRODUCER, RegistrationError

    reg = Registry(heartbeat_timeout_s=3.0)
    kw = dict(model="m", kv_fingerprint="fp", max_model_len=64, tp_size=2)
    dpa = reg.register(worker_id="p", role=PRODUCER, address="p:1", dp_size=2,
                       load=_load((0, 0, 90), (0, 1, 90)), **kw)  # type: ignore[arg-type]
    tp2 = reg.register(worker_id="c", role=CONSUMER, address="c:1", kv_address="k:1,k:2",
                       **kw)  # type: ignore[arg-type]
    assert (attention_tp(dpa), attention_tp(tp2)) == (1, 2)
    assert pick_dp_rank(dpa) == 0 and pick_dp_rank(tp2) is None  # producers place too
    with pytest.raises(RegistrationError, match="dp_size"):
        reg.register(worker_id="bad", role=PRODUCER, address="b:1", dp_size=3,
                     **kw)  # type: ignore[arg-type]
