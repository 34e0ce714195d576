"""The worker's gRPC <-> engine messages: every type round-trips; bad input is a clear error."""

from __future__ import annotations

import dataclasses

import msgpack
import numpy as np
import pytest

from engine.request import LogprobRow
from engine.sampling_params import SamplingParams
from worker import messages as m
from worker import token_batch as tb
from worker.load_report import HeldRow, LoadReport

ROW = LogprobRow(7, -0.25, ((7, -0.25), (3, -1.5)))
SAMPLES: list[m.Message] = [
    m.PrefillCmd("r1", (1, 2, 3), SamplingParams(temperature=0.5, stop=["x"],
                                                 stop_token_ids=[4, 2**40], seed=9,
                                                 structured={"kind": "regex", "value": "a+"}),
                 123),
    m.PrefillCmd("r1", (1, 2, 3), SamplingParams(), 123, (), "tenant-a"),
    m.DestinationCmd("r1", "consumer-0", "ucx://10.0.0.3:1", (4, 5)),
    m.DestinationCmd("r1", "consumer-0", "ucx://10.0.0.3:1", (4, 5, 6), 2),
    m.DecodeCmd("r1", (1, 2), SamplingParams(max_tokens=3, logprobs=2), True),
    m.DecodeCmd("r1", (1, 2), SamplingParams(), False, (), 2, "tenant-a", True),
    m.Token0SentCmd("r1"),
    m.HoldCmd("r1", "consumer-0"),
    m.AbortCmd("r1"),
    m.StopCmd(),
    m.ReadyEvent(m.ReadyInfo("m", "fp", 64, 100, 9, "a", 2, 2, 16, True, True, 1.5)),
    m.ReadyEvent(m.ReadyInfo("m", "fp", 64)),
    m.Token0Event("r1", 7, "hi", ROW, None, "", 10, 11),
    m.Token0Event("r2", 7, "hi", None, "stop", "</s>", 10, 11),
    m.TransferResultEvent("r1", True, "", 1.5),
    m.ReservedEvent("r1", "ucx://x", (0, 1, 2)),
    m.ReservedEvent("r1", "ucx://x", (0, 1, 2), 2),
    m.KVBlocksEvent(3, False, (b"\x01" * 32, b"\x02" * 32)),
    m.KVEventsEvent((m.KVBlocksEvent(1, False, (b"\x01" * 32,)),
                     m.KVBlocksEvent(2, True, (b"\x01" * 32,)))),
    m.KVSnapshotEvent(9, (b"\x03" * 32,)),
    tb.TokensEvent("r1", (7, 8), "ab", (ROW, LogprobRow(8, -0.5)), "length", "", "", 5, 6),
    tb.TokensEvent("r3", (), "", (), "error", error="bad"),
    tb.TokensBatchEvent.of((tb.TokensEvent("r1", (7,), "a", (ROW,), None),
                            tb.TokensEvent("r2", (), "", (), "abort", error="gone"))),
    tb.TokensBatchEvent.of((tb.TokensEvent("r1", (7, 9), "ab", (), None, kv_ready_ns=3,
                                          first_step_ns=4, cached_tokens=16),
                            tb.TokensEvent("r4", (6,), "d", (), None, kv_ready_ns=30,
                                           first_step_ns=31, notice_sent_ns=27,
                                           notice_seen_ns=28, kv_done_ns=29),
                            tb.TokensEvent("r2", (5,), "c", (), "stop", "</s>"))),
    tb.TokensBatchEvent.of(()),
    m.StatsEvent(LoadReport(1, 0, 3, 8)),
    m.StatsEvent(LoadReport(1, 2, 3, 8, requests=(HeldRow("a", "DECODING", 1.25, 0.125, 3),
                                                  HeldRow("b", "QUEUED", 0.001, 0.001, 0)),
                            requests_held=2)),
    m.FatalEvent("boom"),
]


def test_every_message_type_is_sampled() -> None:
    assert {type(s) for s in SAMPLES} == set(m.COMMANDS) | set(m.EVENTS)


@pytest.mark.parametrize("msg", SAMPLES, ids=lambda s: type(s).__name__)
def test_round_trip(msg: m.Message) -> None:
    got = m.decode(m.encode(msg))
    assert got == msg and type(got) is type(msg)


def _i64(*v: int) -> bytes:
    return np.asarray(v, dtype="<i8").tobytes()


def _f64(*v: float) -> bytes:
    return np.asarray(v, dtype="<f8").tobytes()


def _raw(*items: object) -> bytes:
    out: bytes = msgpack.packb(list(items), use_bin_type=True)
    return out


# SamplingParams() as the wire carries it (a field list), and one field of it changed
SP = msgpack.unpackb(m.encode(m.PrefillCmd("r", (1,), SamplingParams(), 0)))[3]
_FIELDS = [f.name for f in dataclasses.fields(SamplingParams)]
_LOAD = msgpack.unpackb(m.encode(m.StatsEvent(LoadReport(1, 2, 3, 4))))[1]  # its field list


def _sp(field: str, value: object) -> list[object]:
    out = list(SP)
    out[_FIELDS.index(field)] = value
    return out


@pytest.mark.parametrize(("data", "names"), [
    (_raw("nope", "r1"), "kind"),
    (_raw("abort"), "abort.rid"),
    (_raw("prefill", "r1", [1, 2]), "prefill.sampling"),
    (_raw("prefill", "r1", [1, "x"], SP, 1), "prefill.prompt_ids"),
    (_raw("prefill", "r1", [1], SP, "late"), "prefill.received_ns"),
    (_raw("prefill", "r1", [1], {}, 1), "prefill.sampling"),
    (_raw("prefill", "r1", [1], _sp("stop", ["a", 3]), 1), "prefill.sampling.stop"),
    (_raw("prefill", "r1", [1], _sp("temperature", "hot"), 1), "prefill.sampling.temperature"),
    (_raw("prefill", "r1", [1], _sp("temperature", -1.0), 1), "prefill.sampling.temperature"),
    (_raw("prefill", "r1", [1], _sp("structured", {"kind": 1}), 1),
     "prefill.sampling.structured"),
    (_raw("dest", "r1", "c", "addr", [1, True]), "dest.block_ids"),
    (_raw("dest", "r1", "c", "addr", [1], "2"), "dest.cached_blocks"),
    (_raw("kvsnap", 1, ["ab"]), "kvsnap.hashes"),
    (_raw("kv", [[1, False, [b"x"]], [2, "no", []]]), "kv.items: expected the events as 4"),
    (_raw("kv", [_i64(1, 2), _i64(0, 2), _i64(1, 0), [b"x"]]), "kv.items: expected event"),
    (_raw("kv", [_i64(1, 2), _i64(0, 1), _i64(1, 1), [b"x"]]), "kv.items: expected event"),
    (_raw("kv", [_i64(1), _i64(0), _i64(1), ["x"]]), "kv.items: expected the events as col"),
    (_raw("decode", "r1", [1], SP, 1), "decode.colocated"),
    (_raw("token0", "r1", 1, "t", [1, -0.1], None, "", 0, 0), "token0.logprob"),
    (_raw("tokens", "r1", [1], "t", [[1, -0.1, [[2]]]], None), "tokens.logprobs"),
    (_raw("stats", [1, 2]), "stats.load"),
    (_raw("stats", [*_LOAD[:12], [["a"], ["DECODING"], _f64(1.0), _f64(1.0), b""]]),
     "stats.load.requests"),
    (_raw("stats", [*_LOAD[:12], [["a"], [7], _f64(1.0), _f64(1.0), _i64(1)]]),
     "stats.load.requests"),
    (_raw("batch", ["r1"]), "batch.counts"),
    (_raw("batch", ["r1", 7], _i64(1, 1), _i64(5, 6), ["a", "b"]), "batch.rids"),
    (_raw("batch", ["r1"], [1], _i64(5), ["a"]), "batch.counts"),
    (_raw("batch", ["r1", "r2"], _i64(1), _i64(5), ["a", "b"]), "batch.counts"),
    (_raw("batch", ["r1"], _i64(-1), b"", ["a"]), "batch.counts"),
    (_raw("batch", ["r1"], _i64(2), _i64(5), ["a"]), "batch.ids"),
    (_raw("batch", ["r1"], _i64(1), _i64(5)[:-1], ["a"]), "batch.ids"),
    (_raw("batch", ["r1"], _i64(1), _i64(-5), ["a"]), "batch.ids"),
    (_raw("batch", ["r1"], _i64(1), _i64(5), [b"a"]), "batch.texts"),
    (_raw("batch", ["r1"], _i64(1), _i64(5), ["a"], _i64(1), ["stop"], [""], [""]),
     "batch.ended"),
    (_raw("batch", ["r1"], _i64(1), _i64(5), ["a"], _i64(0), [], [], []), "batch.finishes"),
    (_raw("batch", ["r1"], _i64(1), _i64(5), ["a"], _i64(0), ["exploded"], [""], [""]),
     "batch.finishes"),
    (_raw("batch", ["r1"], _i64(1), _i64(5), ["a"], b"", [], [], [], _i64(0), _i64(1),
          _i64(2), b""), "batch.cached_tokens"),
    (_raw("batch", ["r1"], _i64(1), _i64(5), ["a"], b"", [], [], [], b"", b"", b"", b"",
          _i64(2), _i64(5), _f64(-0.5), _i64(0)), "batch.lp_ids"),
    (_raw("batch", ["r1"], _i64(1), _i64(5), ["a"], b"", [], [], [], _i64(0), _i64(1),
          _i64(2), _i64(3), b"", b"", b"", b"", b"", b"", _i64(7, 8), _i64(8), _i64(9)),
     "batch.notice_sent_ns"),
    (_raw("batch", ["r1"], _i64(1), _i64(5), ["a"], b"", [], [], [], _i64(0), _i64(1),
          _i64(2), _i64(3), b"", b"", b"", b"", b"", b"", _i64(7), _i64(8), [9]),
     "batch.kv_done_ns"),
    (_raw("batch", ["r1", "r2"], _i64(1, 0), _i64(5), ["a", ""], b"", [], [], [], b"", b"",
          b"", b"", _i64(1), _i64(5), _f64(-0.5), _i64(0)), "batch.lp_counts"),
    (_raw("batch", ["r1"], _i64(1), _i64(5), ["a"], b"", [], [], [], b"", b"", b"", b"",
          _i64(1), _i64(5), _f64(-0.5), _i64(2), _i64(3), _f64(-1.0)), "batch.top_ids"),
    (_raw("batch", ["r1"], _i64(1), _i64(5), ["a"], b"", [], [], [], b"", b"", b"", b"",
          _i64(1), _i64(5), [-0.5], _i64(0)), "batch.lp_values"),
    (_raw("batch", ["r1"], _i64(1), _i64(5), ["a"], b"", [], [], [], b"", b"", b"", b"",
          _i64(1), _i64(5), _f64(-0.5), _i64(1), _i64(3), b""), "batch.top_values"),
    (_raw("abort", "r1", "extra"), "abort"),
    (_raw(), "message"),
    (msgpack.packb({"kind": "abort"}), "message"),
    (m.encode(m.AbortCmd("r1"))[:-2], "message"),
    (b"\xc1", "message"),
])
def test_bad_messages_are_rejected_by_name(data: bytes, names: str) -> None:
    with pytest.raises(m.MessageError) as e:
        m.decode(data)
    assert str(e.value).startswith(names)
    assert isinstance(e.value, ValueError)


def test_messages_are_frozen() -> None:
    with pytest.raises(dataclasses.FrozenInstanceError):
        m.AbortCmd("r1").rid = "r2"  # type: ignore[misc]


def test_a_token_batch_is_the_same_tokens_as_its_events() -> None:
    """The columnar step message gives back exactly the per-request events it was built
    from: tokens, texts, finish and stop reasons, errors, timings, logprobs to the bit."""
    events = (
        tb.TokensEvent("a", (7, 8), "xy", (ROW, LogprobRow(8, -0.1234567890123, ())), None,
                       kv_ready_ns=5, first_step_ns=6, cached_tokens=3, notice_sent_ns=2,
                       notice_seen_ns=3, kv_done_ns=4),
        tb.TokensEvent("b", (), "", (), "error", error="kv transfer failed"),
        tb.TokensEvent("c", (9,), "z", (), "stop", stop_reason="z"),
        tb.TokensEvent("d", (2**32 - 1,), "é", (LogprobRow(1, float("-inf")),), "length"),
        tb.TokensEvent("e", (4,), "q", (), None),
    )
    batch = m.decode(m.encode(tb.TokensBatchEvent.of(events)))
    assert isinstance(batch, tb.TokensBatchEvent)
    assert batch.events() == events
    assert batch.events([4, 1]) == (events[4], events[1])
    assert batch.counts == [2, 0, 1, 1, 1] and batch.ended == [1, 2, 3]
    plain = tb.TokensBatchEvent.of(events[4:])  # no request asked for logprobs: no columns
    assert plain.lp_counts == [] and plain.events() == events[4:]
