"""The benchmark's metric definitions on hand-made timelines (vLLM `bench serve` semantics)."""

from __future__ import annotations

import math

import pytest

from deploy.benchmark.load import arrival_offsets
from deploy.benchmark.metrics import PointContext, distribution, parse_goodput, summarize
from deploy.benchmark.record import RequestRecord
from deploy.benchmark.workload import LengthRange, random_workload


def rec(i: int, start: float, arrivals: list[tuple[float, int]], end: float,
        tokens: int | None = None, prompt: int = 10, error: str = "") -> RequestRecord:
    r = RequestRecord(i, prompt, 8, start=start, end=end, arrivals=arrivals)
    r.output_tokens = sum(n for _, n in arrivals) if tokens is None else tokens
    r.error, r.success = error, not error
    return r


def test_single_request_definitions() -> None:
    # Sent at t=1; token 0 at 1.1; tokens 1-2 together at 1.3; token 3 at 1.4; end at 1.5.
    r = rec(0, 1.0, [(1.1, 1), (1.3, 2), (1.4, 1)], 1.5)
    assert r.ttft == pytest.approx(0.1)
    assert r.ttst == pytest.approx(0.3)  # the message carrying the 2nd token
    assert r.e2el == pytest.approx(0.5)
    assert r.itl == pytest.approx([0.2, 0.1])  # one gap per message, not per token
    assert r.tpot == pytest.approx((0.5 - 0.1) / 3)


def test_tpot_undefined_for_one_token_and_passes_tpot_slo() -> None:
    one = rec(0, 0.0, [(0.2, 1)], 0.25)
    assert one.tpot is None and one.ttst is None and one.itl == []
    m = summarize([one], PointContext(1.0), slos={"tpot": 1.0, "ttft": 500})
    assert m["tpot_ms"]["count"] == 0 and m["tpot_ms"]["p50"] is None
    assert m["ttft_ms"]["p50"] == pytest.approx(200)
    assert m["good_requests"] == 1  # vLLM counts a missing TPOT as 0 against the SLO


def test_failed_requests_counted_not_hidden() -> None:
    ok = rec(0, 0.0, [(0.1, 1), (0.2, 1)], 0.2)
    bad1 = rec(1, 0.0, [(0.1, 1)], 0.5, error="FINISH_REASON_ERROR: consumer died")
    bad2 = rec(2, 0.0, [], 0.05, error="INVALID_ARGUMENT: prompt too long")
    bad3 = rec(3, 0.0, [], 0.05, error="INVALID_ARGUMENT: prompt too long")
    m = summarize([ok, bad1, bad2, bad3], PointContext(2.0, workers=2))
    assert (m["requests"], m["completed"], m["failed"]) == (4, 1, 3)
    assert m["errors"] == {"INVALID_ARGUMENT: prompt too long": 2,
                           "FINISH_REASON_ERROR: consumer died": 1}
    # Failed requests enter no latency and no throughput.
    assert m["ttft_ms"]["count"] == 1 and m["e2el_ms"]["count"] == 1
    assert m["total_output_tokens"] == 2
    assert m["request_throughput"] == pytest.approx(0.5)
    assert m["output_throughput"] == pytest.approx(1.0)
    assert m["output_throughput_per_worker"] == pytest.approx(0.5)
    assert m["output_throughput_per_gpu"] is None  # no GPUs given


def test_throughputs_goodput_and_pooled_itl() -> None:
    a = rec(0, 0.0, [(0.1, 1), (0.2, 1), (0.3, 1)], 0.3, prompt=100)  # tpot 100 ms
    b = rec(1, 0.0, [(0.5, 1), (0.55, 1)], 0.55, prompt=50)  # ttft 500 ms, tpot 50 ms
    m = summarize([a, b], PointContext(0.5, workers=2, gpus=2),
                  slos={"ttft": 200, "tpot": 200})
    assert m["total_input_tokens"] == 150 and m["total_output_tokens"] == 5
    assert m["output_throughput"] == pytest.approx(10)
    assert m["total_token_throughput"] == pytest.approx(310)
    assert m["output_throughput_per_gpu"] == pytest.approx(5)
    assert m["good_requests"] == 1 and m["request_goodput"] == pytest.approx(2)
    assert m["itl_ms"]["count"] == 3  # 2 gaps + 1 gap, pooled
    assert m["tpot_ms"]["mean"] == pytest.approx(75)


def test_server_timing_distributions() -> None:
    r = rec(0, 0.0, [(0.1, 1)], 0.1)
    r.hold_ms, r.kv_transfer_ms, r.prefill_ms = 0.4, 3.0, 90.0
    colocated = rec(1, 0.0, [(0.1, 1)], 0.1)  # no server P/D timing: left out, not zero
    m = summarize([r, colocated], PointContext(1.0))
    assert m["hold_ms"]["count"] == 1 and m["hold_ms"]["p99"] == pytest.approx(0.4)
    assert m["kv_transfer_ms"]["mean"] == pytest.approx(3.0)


def test_kv_ready_splits_into_its_parts_only_with_every_stamp() -> None:
    from pdserve.v1 import router_pb2

    from deploy.benchmark.grpc_backend import apply_timing

    ms = 1_000_000
    base = 1_700_000_000_000 * ms
    # the router sent token 0 1 ms after the producer let the notice go (a busy router):
    # that part is negative, the others follow in order, and together they are kv_ready_ms
    t = router_pb2.ServerTiming(router_token0_sent_ns=base + 1 * ms,
                                producer_notice_sent_ns=base,
                                consumer_notice_seen_ns=base + ms // 2,
                                consumer_kv_done_ns=base + 3 * ms,
                                consumer_kv_ready_ns=base + 10 * ms,
                                consumer_first_step_ns=base + 12 * ms,
                                producer_token0_sampled_ns=base - 2 * ms)
    r = rec(0, 0.0, [(0.1, 1)], 0.1)
    apply_timing(r, t)
    # the hold's place on the host's timeline (bench/loop_stalls_report.py), as sent
    assert r.hold_ms == pytest.approx(3.0) and r.to_json()["token0_sampled_ns"] == base - 2 * ms
    assert (r.notice_sent_ms, r.notice_wire_ms, r.kv_copy_ms, r.kv_poll_ms) == pytest.approx(
        (-1.0, 0.5, 2.5, 7.0))
    assert r.kv_ready_ms == pytest.approx(9.0) == pytest.approx(
        r.notice_sent_ms + r.notice_wire_ms + r.kv_copy_ms + r.kv_poll_ms)
    row = r.to_json()
    assert row["notice_sent_ms"] == pytest.approx(-1.0) and row["kv_poll_ms"] == 7.0
    # a consumer (or producer) that sends no stamp: no parts, the whole still there
    older = rec(1, 0.0, [(0.1, 1)], 0.1)
    t.ClearField("consumer_notice_seen_ns")
    apply_timing(older, t)
    assert older.kv_ready_ms == pytest.approx(9.0)
    assert (older.notice_sent_ms, older.notice_wire_ms, older.kv_copy_ms,
            older.kv_poll_ms) == (None, None, None, None)
    m = summarize([r, older], PointContext(1.0))
    assert m["kv_copy_ms"]["count"] == 1 and m["kv_copy_ms"]["p50"] == pytest.approx(2.5)
    assert m["notice_sent_ms"]["p50"] == pytest.approx(-1.0)
    assert m["kv_ready_ms"]["count"] == 2


def test_percentiles_linear_and_monotonic() -> None:
    d = distribution([float(v) for v in range(1, 101)])
    assert d["p50"] == pytest.approx(50.5) and d["p99"] == pytest.approx(99.01)
    assert d["p50"] <= d["p90"] <= d["p99"]
    assert distribution([])["mean"] is None


def test_goodput_flag_parsing() -> None:
    assert parse_goodput(["ttft:500", "tpot:50.5"]) == {"ttft": 500.0, "tpot": 50.5}
    for bad in (["itl:5"], ["ttft"], ["ttft:x"], ["ttft:0"]):
        with pytest.raises(ValueError, match="--goodput"):
            parse_goodput(bad)


def test_workload_is_seeded_and_lengths_exact() -> None:
    a = random_workload(5, LengthRange(8, 16), LengthRange.parse("--o", "4"),
                        LengthRange(100, 200), seed=3)
    assert a == random_workload(5, LengthRange(8, 16), LengthRange(4, 4),
                                LengthRange(100, 200), seed=3)
    assert all(8 <= s.prompt_len <= 16 and s.output_len == 4 for s in a)
    assert all(100 <= t <= 200 for s in a for t in s.prompt_ids)
    with pytest.raises(ValueError, match="--input-len"):
        LengthRange.parse("--input-len", "9:3")


def test_poisson_arrivals() -> None:
    assert arrival_offsets(3, math.inf, 0) == [0.0, 0.0, 0.0]
    offs = arrival_offsets(2000, 4.0, 1)
    assert offs == arrival_offsets(2000, 4.0, 1) and offs[0] == 0.0
    assert offs[-1] / (len(offs) - 1) == pytest.approx(0.25, rel=0.1)  # mean gap 1/rate
