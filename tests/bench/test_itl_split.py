"""bench/itl_split.py: the first gap split from the rest, and, where the records carry the
server's handoff stamps, into its parts."""

from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "bench"))

from itl_split import handoff_line, split  # noqa: E402


def _rec(first: float, rest: list[float], ready: float | None, wait: float | None) -> dict:
    return {"itl_ms": [first, *rest], "tpot_ms": 10.0, "kv_ready_ms": ready,
            "first_step_wait_ms": wait}


def test_the_first_gap_is_split_into_its_parts():
    # every request: 40 ms first gap = 25 ms to KV ready + 5 ms to the first step + 10 ms
    recs = [_rec(40.0, [10.0] * 5, 25.0, 5.0) for _ in range(9)]
    line = handoff_line(recs)
    assert line.startswith("whole p50 40.0 p99 40.0; token 0 sent -> KV ready p50 25.0")
    assert "-> first step p50 5.0" in line
    assert "first step -> token 1 at the client p50 10.0 p99 10.0" in line
    assert line.endswith("(9 requests)")


def test_a_result_file_with_and_without_stamps(tmp_path):
    with_stamps = [_rec(40.0, [10.0] * 5, 25.0, 5.0) for _ in range(4)]
    colocated = [_rec(30.0, [10.0] * 5, None, None) for _ in range(4)]
    doc = {"configs": [{"points": [{"concurrency": 4, "requests": with_stamps},
                                   {"concurrency": 8, "requests": colocated}]}]}
    path = tmp_path / "r.json"
    path.write_text(json.dumps(doc))
    lines = split(str(path))
    assert len(lines) == 3  # two points, one handoff line (only the first has stamps)
    assert "c=4: TPOT p50 10.00 ms; ITL p99" in lines[0]
    assert "without the first gap 10.0 (1.00x); first gap p50 40.0" in lines[0]
    assert lines[1].startswith("  first gap, whole p50 40.0")
    assert "c=8:" in lines[2] and "first gap p50 30.0" in lines[2]


def test_the_hold_is_split_at_the_producer_s_send():
    from itl_split import hold_line
    # 3 ms hold: 0.5 ms engine -> the producer's gRPC process, 2.5 ms stream and router
    recs = [{"hold_ms": 3.0, "hold_producer_ms": 0.5} for _ in range(5)]
    line = hold_line(recs)
    assert line.startswith("whole p50 3.00 p99 3.00; sampled -> producer sent p50 0.50")
    assert "-> router sent p50 2.50 p99 2.50" in line and "(5 requests)" in line


def test_the_producer_s_half_splits_at_the_engine_s_emit():
    from itl_split import hold_line
    # producer half 0.9 ms: 0.2 ms in the engine process, 0.7 ms hop to its gRPC process
    recs = [{"hold_ms": 3.0, "hold_producer_ms": 0.9, "hold_engine_ms": 0.2}
            for _ in range(5)]
    line = hold_line(recs)
    assert line.startswith("whole p50 3.00 p99 3.00; sampled -> engine emitted p50 0.20 "
                           "p99 0.20; -> producer sent p50 0.70")
    assert "-> router sent p50 2.10" in line


def test_the_hold_s_tail_is_named_by_its_parts():
    from itl_split import hold_line
    # 99 holds of 2 ms spent on the wire, one of 20 ms spent in the router after its read
    fast = {"hold_ms": 2.0, "hold_producer_ms": 0.5, "hold_writer_ms": 0.2,
            "hold_wire_ms": 1.0, "hold_router_ms": 0.3}
    slow = {"hold_ms": 20.0, "hold_producer_ms": 0.5, "hold_writer_ms": 0.2,
            "hold_wire_ms": 1.0, "hold_router_ms": 18.3}
    line = hold_line([fast] * 99 + [slow])
    assert "-> writer took p50 0.20" in line and "-> router read p50 1.00" in line
    assert "-> router sent p50 0.30" in line
    assert line.endswith("slowest 1% (1), mean ms: whole 20.00, sampled -> producer sent "
                         "0.50, -> writer took 0.20, -> router read 1.00, -> router sent 18.30")


def test_a_point_with_hold_stamps_gets_a_hold_line(tmp_path):
    recs = [{**_rec(40.0, [10.0] * 5, 25.0, 5.0), "hold_ms": 2.0, "hold_producer_ms": 0.5}
            for _ in range(4)]
    path = tmp_path / "r.json"
    path.write_text(json.dumps({"configs": [{"points": [{"concurrency": 4,
                                                          "requests": recs}]}]}))
    lines = split(str(path))
    assert len(lines) == 3 and lines[2].startswith("  hold, whole p50 2.00")


def _parted(ready: float, parts: tuple[float, float, float, float]) -> dict:
    return {**_rec(40.0, [10.0] * 5, ready, 5.0),
            **dict(zip(("notice_sent_ms", "notice_wire_ms", "kv_copy_ms", "kv_poll_ms"), parts,
                       strict=True))}


def test_kv_ready_is_split_into_its_stamped_parts():
    from itl_split import kv_ready_line
    # 99 requests: 25 ms to KV ready = -1 (the router sent token 0 late) + 0.5 on the wire
    # + 3.5 of copies + 22 waiting for the consumer's poll; one of 70 ms lost in its copies
    fast = _parted(25.0, (-1.0, 0.5, 3.5, 22.0))
    slow = _parted(70.0, (-1.0, 0.5, 48.5, 22.0))
    line = kv_ready_line([fast] * 99 + [slow])
    assert line.startswith("whole p50 25.00 p99 ")
    assert "; token 0 sent -> notice sent p50 -1.00 p99 -1.00; -> notice seen p50 0.50 " \
        "p99 0.50; -> KV done p50 3.50 p99 " in line
    assert "; -> admitted p50 22.00 p99 22.00 ms (100 requests)" in line
    assert line.endswith("slowest 1% (1), mean ms: whole 70.00, token 0 sent -> notice sent "
                         "-1.00, -> notice seen 0.50, -> KV done 48.50, -> admitted 22.00")


def test_a_result_file_gets_the_kv_ready_line_only_where_every_part_came(tmp_path):
    parted = [_parted(25.0, (-1.0, 0.5, 3.5, 22.0)) for _ in range(4)]
    older = [_rec(40.0, [10.0] * 5, 25.0, 5.0) for _ in range(4)]  # a server without them
    doc = {"configs": [{"points": [{"concurrency": 4, "requests": parted},
                                   {"concurrency": 8, "requests": older}]}]}
    path = tmp_path / "r.json"
    path.write_text(json.dumps(doc))
    lines = split(str(path))
    assert len(lines) == 5
    assert lines[1].startswith("  first gap, whole p50 40.0")
    assert lines[2].startswith("  KV ready, whole p50 25.00 p99 25.00; token 0 sent -> "
                               "notice sent p50 -1.00")
    assert "(4 requests)" in lines[2]
    assert "c=8:" in lines[3] and lines[4].startswith("  first gap, ")


def test_the_kv_ready_line_counts_destinations_that_came_after_token0():
    from itl_split import kv_ready_line
    # 98 requests whose destination went 30 ms before token 0; two whose went 10 and 50 ms
    # after it, the slower of them the slowest KV ready
    early = {**_parted(25.0, (1.0, 0.5, 3.5, 20.0)), "dest_after_token0_ms": -30.0}
    late = {**_parted(40.0, (16.0, 0.5, 3.5, 20.0)), "dest_after_token0_ms": 10.0}
    later = {**_parted(80.0, (56.0, 0.5, 3.5, 20.0)), "dest_after_token0_ms": 50.0}
    line = kv_ready_line([early] * 98 + [late, later])
    assert line.endswith("; destination after token 0 for 2 of 100, by p50 30.00 p99 49.60 "
                         "ms (the slowest 1%: 50.00 ms mean)")
    # the slowest ones had their destination 30 ms before token 0: none of them was late
    slow_early = {**_parted(90.0, (1.0, 0.5, 3.5, 85.0)), "dest_after_token0_ms": -30.0}
    line = kv_ready_line([early] * 99 + [slow_early])
    assert line.endswith("for 0 of 100 (the slowest 1%: 0.00 ms mean)")
    # records without the stamp (an older router): no destination clause
    assert "destination" not in kv_ready_line([_parted(25.0, (1.0, 0.5, 3.5, 20.0))] * 4)
