"""worker/load_board.py: the shared block between a worker's loop and its heartbeat process.

The reader here is a real spawned process reading the same block, as the heartbeat process
does; the peak's restart and the oversized report are checked in-process."""

from __future__ import annotations

import multiprocessing as mp
from typing import Any

import pytest
from pdserve.v1 import common_pb2

from worker.load_board import LOAD_MAX, LoadBoard, new_raw
from worker.load_report import DPRankLoad, LoadReport
from worker.loop_watch import LoopWatch


def _read_in_child(raw: Any, out: Any) -> None:
    lag, age, load = LoadBoard(raw, clock=lambda: 100.0).read()
    out.put((lag, age, load))


def test_a_spawned_reader_sees_what_the_loop_posted() -> None:
    ctx = mp.get_context("spawn")
    raw = new_raw(ctx)
    board = LoadBoard(raw)
    load = common_pb2.WorkerLoad(waiting=3, running=5, kv_blocks_free=7, kv_blocks_total=11)
    board.tick(0.1, 97.0, 0.4, 1.5, load.SerializeToString())
    board.tick(0.1, 99.0, 0.2, 2.5)  # no new report: the last one stays
    out = ctx.Queue()
    p = ctx.Process(target=_read_in_child, args=(raw, out))
    p.start()
    lag, age, got = out.get(timeout=30)
    p.join(10)
    # now (100) - ticked (99) - tick (0.1) = 0.9 overdue, above the peak (0.4)
    assert lag == pytest.approx(0.9) and age == 2.5
    assert common_pb2.WorkerLoad.FromString(got) == load


def test_the_peak_restarts_after_each_read() -> None:
    now = [10.0]
    board = LoadBoard(new_raw(mp.get_context("spawn")), clock=lambda: now[0])
    board.tick(0.1, 10.0, 3.0, 0.0, b"")
    assert board.read()[0] == 3.0  # a stall that ended before the read: reported once
    board.tick(0.1, 10.0, 0.0, 0.0)
    assert board.read()[0] == 0.0
    now[0] = 12.1  # a stall in progress shows without a tick
    assert board.read()[0] == pytest.approx(2.0)


def test_a_report_too_big_for_the_board_loses_its_group_rows_not_the_tick() -> None:
    with pytest.raises(ValueError, match="the board holds"):
        LoadBoard(new_raw(mp.get_context("spawn"))).tick(0.1, 1.0, 0.0, 0.0,
                                                        b"x" * (LOAD_MAX + 1))
    ranks = tuple(DPRankLoad(i, i, i, i) for i in range(20_000))
    report = LoadReport(1, 2, 3, 4, dp_ranks=ranks)
    watch = LoopWatch(lambda: report)
    watch.tick()
    _, _, raw = watch.board.read()
    got = common_pb2.WorkerLoad.FromString(raw)
    assert (got.waiting, got.running, got.kv_blocks_free, got.kv_blocks_total) == (1, 2, 3, 4)
    assert len(got.dp_ranks) == 0
