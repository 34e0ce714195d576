"""The engine loop counts its steps (number, rows, step wall time, time between steps), the
load report carries the totals, /metrics exports them, and a log line summarizes each
window while busy."""

from __future__ import annotations

import os
import re

import pytest
import zmq
from event_link_pair import events_pair, received
from tiny_models import make_tiny_model

from consumer.colocated import ColocatedHandler
from engine.llm import LLM
from engine.outputs import RequestOutput
from engine.request_state import RequestState
from engine.sampling_params import SamplingParams
from worker import ipc
from worker.engine_loop import WorkerLoop, load_report
from worker.load_report import LoadReport
from worker.messages import DecodeCmd, Event, StatsEvent, decode, encode
from worker.metrics_server import WorkerMetrics
from worker.step_stats import StepStats
from worker.token_batch import TokensBatchEvent


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def _out(n: int) -> RequestOutput:
    return RequestOutput("r", list(range(n)), "", RequestState.DECODING, None, 3, n, 0, 0)


def test_step_and_gap_times_count_only_consecutive_steps() -> None:
    clock = Clock()
    s = StepStats(clock)
    clock.t = 100.0
    s.start()
    clock.t = 100.004  # a 4 ms step with two rows, one of them two tokens
    s.end([_out(1), _out(2), _out(0)])
    clock.t = 100.005  # 1 ms later the next step
    s.start()
    clock.t = 100.007
    s.end([_out(1)])
    s.idle()  # the engine ran dry: the 5 s wait below is no gap
    clock.t = 105.0
    s.start()
    clock.t = 105.003
    s.end([])
    c = s.counters()
    assert (c.steps, c.rows, c.tokens) == (3, 3, 4)
    assert c.seconds == pytest.approx(0.009)
    assert c.gaps == 1
    assert c.gap_seconds == pytest.approx(0.001)


def test_window_line_reports_the_window_means_and_stays_quiet_when_idle() -> None:
    clock = Clock()
    s = StepStats(clock)
    assert s.window_line() is None  # opens the first window
    for _ in range(4):  # 4 steps of 5 ms, 2 rows each, 1 ms apart
        s.start()
        clock.t += 0.005
        s.end([_out(1), _out(1)])
        clock.t += 0.001
    assert s.window_line(every_s=10.0) is None  # the window is not over
    clock.t = 110.5
    line = s.window_line(every_s=10.0)
    assert line == ("steps: 4 in 10.5 s, mean batch 2.00, step 5.00 ms (max 5.0), "
                    "between steps 1.00 ms (max 1.0)")
    clock.t = 121.0
    assert s.window_line(every_s=10.0) is None  # no steps in that window: no line


def test_window_line_shows_the_longest_step_gap_and_gc_pause_of_that_window_only() -> None:
    clock = Clock()
    s = StepStats(clock)
    s.window_line()
    for step_s, gap_s in ((0.005, 0.001), (0.040, 0.001), (0.005, 0.030), (0.005, 0.001)):
        s.start()
        clock.t += step_s
        s.end([_out(1)])
        clock.t += gap_s
    clock.t = 110.0
    s.idle()  # the loop waited for work: not a gap
    line = s.window_line(every_s=10.0, gc_pause_s=0.0125)
    # mean step 13.75 ms hides the 40 ms stall a stream sees; the max shows it
    assert line == ("steps: 4 in 10.0 s, mean batch 1.00, step 13.75 ms (max 40.0), "
                    "between steps 10.67 ms (max 30.0), longest gc pause 12.5 ms")
    s.start()
    clock.t += 0.002
    s.end([_out(1)])
    clock.t = 121.0
    assert s.window_line(every_s=10.0) == ("steps: 1 in 11.0 s, mean batch 1.00, step 2.00 ms "
                                           "(max 2.0), between steps 0.00 ms (max 0.0)")


def _metric(text: str, name: str) -> float:
    m = re.search(rf"^{name}\{{[^}}]*\}} (\S+)$", text, re.M)
    assert m is not None, f"{name} missing:\n{text}"
    return float(m.group(1))


def test_metrics_export_the_step_counters() -> None:
    s = StepStats(Clock())
    s.start()
    s.clock.t += 0.25  # type: ignore[attr-defined]
    s.end([_out(1), _out(1), _out(1)])
    load = LoadReport(0, 0, 0, 0, steps=s.counters())
    text = WorkerMetrics("w1", "consumer", lambda: load).render().decode()
    assert _metric(text, "pdserve_worker_engine_steps_total") == 1
    assert _metric(text, "pdserve_worker_engine_step_rows_total") == 3
    assert _metric(text, "pdserve_worker_engine_step_tokens_total") == 3
    assert _metric(text, "pdserve_worker_engine_step_seconds_total") == pytest.approx(0.25)
    assert _metric(text, "pdserve_worker_engine_step_gap_seconds_total") == 0
    assert _metric(text, "pdserve_worker_engine_step_gaps_total") == 0


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> str:
    return make_tiny_model(os.path.join(tmp_path_factory.mktemp("steps"), "llama"), "llama")


def test_a_real_engine_loop_counts_every_step_of_a_request(tiny_llama: str) -> None:
    """Real sockets, a real tiny engine and the colocated role: the load report's counters
    match what the request went through."""
    eng = LLM(tiny_llama, role="colocated", block_size=4).engine
    paths = ipc.IpcPaths.fresh()
    ctx = zmq.Context()
    try:
        pull = ipc.bind_pull(ctx, paths.commands)
        push = ipc.connect_push(ctx, paths.commands)
        ev_pull, events = events_pair(paths.events)
        emitted: list[Event] = []

        def emit(ev: Event) -> None:
            emitted.extend(ev.events() if isinstance(ev, TokensBatchEvent) else (ev,))

        loop = WorkerLoop(ColocatedHandler(eng, emit), pull, events)
        params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
        push.send(encode(DecodeCmd("a", (5, 17, 33, 90, 12), params, False)))
        turns = 0
        while not any(getattr(e, "finish", None) for e in emitted):
            loop.turn()
            turns += 1
            assert turns < 200
        c = load_report(loop.handler, loop.steps).steps
        tokens = sum(len(e.ids) for e in emitted)  # type: ignore[attr-defined]
        assert tokens == 20
        # every turn stepped (the command came before the first), and every step after
        # the first followed a step
        assert c.steps == turns
        assert c.gaps == turns - 1
        assert c.tokens == 20
        assert c.rows == 20  # one request, one token a step
        assert 0 < c.seconds and 0 < c.gap_seconds
        # what the loop sent: its load reports carry the same counters, as of then
        reports: list[LoadReport] = []
        for msg in (decode(p) for parts in received(ev_pull, 0.05) for p in parts):
            if isinstance(msg, StatsEvent):
                reports.append(msg.load)
        assert reports and reports[0].steps.steps <= c.steps
    finally:
        ctx.destroy(linger=0)
        ev_pull.close()
        paths.cleanup()
