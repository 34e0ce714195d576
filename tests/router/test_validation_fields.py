"""The one table of sampling fields: the router's validation and the worker's conversion read
a wire SamplingParams the same way (float32 rounding included), and accept and refuse the
same values with the same words."""

from __future__ import annotations

import dataclasses
import struct
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pdserve.v1 import common_pb2

from engine.sampling_fields import BY_NAME, FIELDS, MAX_LOGPROBS, f32, wire_values
from engine.sampling_params import SamplingParams
from router.requests.validation import engine_params
from worker.convert import ModelLimits, checked_request, sampling_to_wire

LIMITS = ModelLimits(vocab_size=1000, max_model_len=4096)


def as_f32(x: float) -> float:
    return float(struct.unpack("<f", struct.pack("<f", x))[0])


def router_view(s: common_pb2.SamplingParams) -> dict[str, Any] | str:
    try:
        return engine_params(s).to_dict()
    except ValueError as e:
        return str(e).split(":")[0]


def worker_view(s: common_pb2.SamplingParams) -> dict[str, Any] | str:
    try:
        return checked_request("r", [1, 2], s, 7, LIMITS).to_dict()
    except ValueError as e:
        return str(e).split(":")[0]


def test_table_matches_the_engine_dataclass_and_the_proto() -> None:
    dc = {f.name: f for f in dataclasses.fields(SamplingParams)}
    assert set(dc) - {"structured"} == set(BY_NAME)  # a grammar message, not a table row
    for f in FIELDS:
        d = dc[f.name]
        default = d.default if d.default is not dataclasses.MISSING else d.default_factory()  # type: ignore[misc]
        assert default == (list(f.default) if isinstance(f.default, tuple) else f.default), f.name
    proto = common_pb2.SamplingParams.DESCRIPTOR.fields_by_name
    assert set(proto) - {"structured"} == set(BY_NAME)
    for f in FIELDS:
        # proto3 `optional` (presence tracked) exactly where the table says unset = default
        assert proto[f.name].has_presence == f.optional, f.name
        assert (proto[f.name].type == proto[f.name].TYPE_FLOAT) == (f.kind == "float"), f.name


def test_f32_gives_the_shortest_decimal_of_the_same_float32() -> None:
    assert f32(as_f32(0.1)) == 0.1
    assert f32(as_f32(0.7)) == 0.7
    assert f32(as_f32(1.0000001)) == 1.0000001  # just above 1, and stays so
    assert f32(as_f32(1e-46)) == 0.0
    for x in (0.123456789, 3.3333333, 1e-30, 1.9999999):
        assert as_f32(f32(as_f32(x))) == as_f32(x)


def test_a_temperature_positive_in_float64_but_zero_in_float32_is_greedy_for_both() -> None:
    s = common_pb2.SamplingParams(temperature=1e-46)
    r, w = engine_params(s), SamplingParams(**sampling_to_wire(s, 1))
    assert r.temperature == w.temperature == 0.0 and r.greedy and w.greedy


def test_top_p_just_above_one_in_float32_is_refused_by_both() -> None:
    s = common_pb2.SamplingParams(top_p=1.0000001)
    assert router_view(s) == "sampling.top_p"
    assert worker_view(s) == "sampling.top_p"


def test_both_see_the_same_rounded_values() -> None:
    s = common_pb2.SamplingParams(temperature=0.7, top_p=0.9, min_p=0.05,
                                  repetition_penalty=1.1, frequency_penalty=-0.3,
                                  presence_penalty=0.2, max_tokens=9, top_k=5, logprobs=3)
    r = router_view(s)
    assert isinstance(r, dict)
    assert (r["temperature"], r["top_p"], r["min_p"], r["repetition_penalty"]) == (
        0.7, 0.9, 0.05, 1.1)
    w = worker_view(s)
    assert isinstance(w, dict)
    r.pop("seed"), w.pop("seed")
    assert r == w


@pytest.mark.parametrize("kw,field", [
    (dict(max_tokens=0), "max_tokens"), (dict(min_tokens=5, max_tokens=4), "min_tokens"),
    (dict(temperature=-0.5), "temperature"), (dict(temperature=float("inf")), "temperature"),
    (dict(top_p=0.0), "top_p"), (dict(top_k=-2), "top_k"), (dict(min_p=1.5), "min_p"),
    (dict(repetition_penalty=0.0), "repetition_penalty"),
    (dict(frequency_penalty=2.5), "frequency_penalty"),
    (dict(presence_penalty=float("nan")), "presence_penalty"),
    (dict(stop=[""]), "stop"), (dict(stop=["x"] * 17), "stop"),
    (dict(logprobs=MAX_LOGPROBS + 1), "logprobs"), (dict(seed=2**63), "seed"),
])
def test_each_bad_field_is_refused_by_both_naming_it(kw: dict[str, Any], field: str) -> None:
    s = common_pb2.SamplingParams(**kw)
    assert router_view(s) == f"sampling.{field}"
    if field != "seed":  # the worker takes the router's resolved seed (checked below)
        assert worker_view(s) == f"sampling.{field}"


def test_worker_request_checks_name_the_field() -> None:
    ok = common_pb2.SamplingParams(max_tokens=4)
    cases = [
        (("", [1], ok, 1), "request_id"), (("x" * 300, [1], ok, 1), "request_id"),
        (("r", [], ok, 1), "prompt_token_ids"), (("r", [1, 1000], ok, 1), "prompt_token_ids[1]"),
        (("r", [1], ok, 2**63), "seed"),
        (("r", [1], common_pb2.SamplingParams(stop_token_ids=[3, 5000], min_tokens=2), 1),
         "sampling.stop_token_ids[1]"),
        (("r", [1] * 4096, ok, 1), "prompt_token_ids"),
        (("r", [1] * 4093, ok, 1), "sampling.max_tokens"),
    ]
    for args, field in cases:
        with pytest.raises(ValueError) as e:
            checked_request(*args, LIMITS)  # type: ignore[arg-type]
        assert str(e.value).split(":")[0] == field, (args[:2], str(e.value))
    d = checked_request("r", [1] * 4092, ok, 5, LIMITS)
    assert d.max_tokens == 4 and d.seed == 5


floats = st.one_of(st.floats(allow_nan=True, allow_infinity=True, width=32),
                   st.sampled_from([0.0, 1e-46, 1e-7, 1.0, 1.0000001, 2.0, 2.0000002, -2.0]))


@settings(max_examples=300, deadline=None)
@given(st.fixed_dictionaries({}, optional={
    "max_tokens": st.integers(0, 5000), "min_tokens": st.integers(0, 5000),
    "temperature": floats, "top_p": floats, "top_k": st.integers(-5, 2000), "min_p": floats,
    "repetition_penalty": floats, "frequency_penalty": floats, "presence_penalty": floats,
    "stop": st.lists(st.text(max_size=3), max_size=18),
    "stop_token_ids": st.lists(st.integers(0, 999), max_size=4),
    "logprobs": st.integers(0, 25), "ignore_eos": st.booleans(),
    "skip_special_tokens": st.booleans()}))
def test_router_and_worker_agree_on_any_sampling(kw: dict[str, Any]) -> None:
    s = common_pb2.SamplingParams(**kw)
    r, w = router_view(s), worker_view(s)
    if isinstance(r, dict) and isinstance(w, dict):
        r.pop("seed"), w.pop("seed")
        assert r == w
    elif isinstance(w, str) and w == "sampling.max_tokens" and isinstance(r, dict):
        assert r["max_tokens"] + 2 > LIMITS.max_model_len  # the worker's length rule
    else:
        assert r == w
    assert wire_values(s).keys() >= {f.name for f in FIELDS if not f.optional}


@pytest.mark.parametrize("x", [3.4025001647762064e+38, 3.4028234663852886e+38, -3.4e+38])
def test_f32_near_the_float32_maximum_round_trips(x: float) -> None:
    # found by hypothesis: a short decimal of a value near FLT_MAX rounds past it, and
    # packing that raised OverflowError out of the router's and the worker's validation
    (want,) = struct.unpack("<f", struct.pack("<f", x))
    assert struct.unpack("<f", struct.pack("<f", f32(x)))[0] == want


def test_f32_past_the_float32_range_is_an_infinity() -> None:
    assert f32(1e39) == float("inf") and f32(-1e39) == float("-inf")
