"""The router keeps each worker's TP size (Register -> WorkerStatus) and tells a consumer
its producer's, so each consumer rank takes its heads from the right producer ranks."""

from __future__ import annotations

import pytest

from router.control.registry import CONSUMER, PRODUCER, RegistrationError, Registry


def _register(reg: Registry, wid: str, role: int, tp: int) -> object:
    return reg.register(worker_id=wid, role=role, address=f"{wid}:1",
                        kv_address="tcp://h:1,tcp://h:2" if role == CONSUMER else "",
                        model="m", kv_fingerprint="fp", max_model_len=64, tp_size=tp)


def test_workers_of_different_tp_register_and_pair_by_fingerprint():
    reg = Registry(heartbeat_timeout_s=3.0)
    p = _register(reg, "p", PRODUCER, 2)
    c = _register(reg, "c", CONSUMER, 1)  # same KV content: different TP pairs
    assert (p.tp_size, c.tp_size) == (2, 1)  # type: ignore[attr-defined]


@pytest.mark.parametrize("tp", [0, 257, -1])
def test_a_tp_size_out_of_range_is_refused_naming_the_field(tp):
    with pytest.raises(RegistrationError, match="tp_size"):
        _register(Registry(heartbeat_timeout_s=3.0), "p", PRODUCER, tp)


def test_the_decode_leg_carries_the_producers_tp_size():
    from pdserve.v1 import worker_pb2

    req = worker_pb2.DecodeRequest(request_id="r", source_tp_size=4)
    again = worker_pb2.DecodeRequest.FromString(req.SerializeToString())
    assert again.source_tp_size == 4
    # an older router sends none: 0, which the consumer reads as "same as mine"
    assert worker_pb2.DecodeRequest(request_id="r").source_tp_size == 0
