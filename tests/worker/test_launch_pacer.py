"""Launch pacing: while KV transfers are in flight the engine loop launches the next step
shortly before the running one ends, so a request whose KV lands meanwhile joins it.

The pacer's arithmetic on engine marks, then the real WorkerLoop (real ZMQ sockets) over a
simulated device timeline as the seam: steps of STEP_S run back to back on one device,
each launched step queued behind the one running, its ids read when it ends (as
engine/sim_runner.py and a GPU do), and a transfer that lands a fifth of the way into a
step. With pacing the request is admitted before the next launch and is in that step;
without, the launch goes out at once and the request waits a step more.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import zmq
from event_link_pair import events_pair

from engine.outputs import StepResult
from engine.step_timing import StepTiming
from worker import ipc
from worker.engine_loop import WorkerLoop
from worker.launch_pacer import MIN_MARGIN_S, LaunchPacer
from worker.load_report import LoadReport

MS = 1_000_000


def _timing(entered: float, launched: float, read_launched: float, read: float) -> StepTiming:
    return StepTiming(int(entered * MS), int(launched * MS), int(read_launched * MS),
                      int(read * MS))


def test_pacer_waits_until_shortly_before_the_running_step_ends() -> None:
    p = LaunchPacer()
    # steps of 20 ms back to back; the host takes 1 ms from step() entry to the launch
    p.observe(_timing(0, 1, 0, 0))  # the first launch reads nothing
    p.observe(_timing(2, 3, 1, 21))  # reads step 1 (ran 1..21); step 2 runs from 21
    p.observe(_timing(22, 23, 3, 41))  # reads step 2 (21..41); step 3 runs from 41
    assert p.device_s is not None and abs(p.device_s - 0.020) < 1e-6
    assert p.launch_s is not None and abs(p.launch_s - 0.001) < 1e-6
    # step 3 ends at 61 ms: launch at 61 - 1 (host) - 3 (15% of 20 ms) = 57 ms
    assert abs(p.wait_s(42 * MS, True, True) - 0.015) < 1e-6
    assert p.wait_s(58 * MS, True, True) == 0.0  # past the launch time: at once
    assert p.wait_s(42 * MS, True, False) == 0.0  # nothing could join
    assert p.wait_s(42 * MS, False, True) == 0.0  # nothing on the device
    assert LaunchPacer(enabled=False).wait_s(42 * MS, True, True) == 0.0


def test_idle_time_and_late_reads_are_not_taken_for_device_time() -> None:
    """20 ms steps. A step launched onto an idle device ran from its launch, not from the
    last read; a read that found its step long done (the host came late) is no sample. Either
    mistake would make the next launch later still."""
    p = LaunchPacer()
    p.observe(_timing(0, 1, 0, 0))
    p.observe(_timing(2, 3, 1, 21))  # step 1 read; step 2 runs 21..41
    p.observe(_timing(22, 23, 3, 41))  # step 2: 20 ms; step 3 runs 41..61
    # the host comes back at 70: step 4 launched at 71, step 3 read at once (done at 61)
    p.observe(_timing(70, 71, 23, 71.1))
    assert p.device_s is not None and abs(p.device_s - 0.020) < 1e-6
    # step 4 ran from its launch (the device was idle) 71..91, read waiting at 91
    p.observe(_timing(89, 90, 71, 91))
    assert abs(p.device_s - 0.020) < 1e-4  # from the late read at 71.1, not from 41 or 61


def test_short_steps_are_not_paced() -> None:
    p = LaunchPacer()
    p.observe(_timing(0, 0.1, 0, 0))
    p.observe(_timing(0.2, 0.3, 0.1, 2.1))
    p.observe(_timing(2.2, 2.3, 0.3, 4.1))  # 2 ms steps
    assert p.wait_s(int(2.4 * MS), True, True) == 0.0


STEP_S = 0.15


class Device:
    """An engine whose steps run STEP_S each on one simulated device, back to back."""

    def __init__(self) -> None:
        self.timing = StepTiming()
        self.free_at = 0.0
        self.inflight: tuple[float, float, set[str]] | None = None  # launch, end, members
        self.admitted: set[str] = set()
        self.steps_with: dict[str, int] = {}  # request -> index of the first step it was in
        self.launches = 0
        self.held_requests = list
        self.drain_kv_events = list
        self.defers_output = True  # a consumer's: the paced kind

    @property
    def has_inflight(self) -> bool:
        return self.inflight is not None

    def has_unfinished(self) -> bool:
        return True

    def step(self) -> StepResult:
        tm = self.timing
        now = time.time()
        tm.entered_ns = int(now * 1e9)
        tm.read_ns = tm.read_launched_ns = 0
        members = set(self.admitted)
        for rid in members:
            self.steps_with.setdefault(rid, self.launches)
        self.launches += 1
        end = max(now, self.free_at) + STEP_S
        self.free_at = end
        launched = (now, end, members)
        tm.launched_ns = int(time.time() * 1e9)
        if self.inflight is not None:
            _, prev_end, _ = self.inflight
            time.sleep(max(0.0, prev_end - time.time()))  # the host sync
            tm.read_ns = int(time.time() * 1e9)
            tm.read_launched_ns = int(self.inflight[0] * 1e9)
        self.inflight = launched
        return StepResult()


class AwaitingRole:
    """A consumer with one transfer in flight that lands at `land_at` (wall clock)."""

    def __init__(self, engine: Device) -> None:
        self.engine = engine
        self.land_at = float("inf")
        self.admitted_at: float | None = None
        self.flush_events = lambda: None

    def awaiting_kv(self) -> bool:
        return self.admitted_at is None

    def after_step(self) -> None:
        if self.admitted_at is None and time.time() >= self.land_at:
            self.admitted_at = time.time()
            self.engine.admitted.add("new")

    def on_command(self, cmd: Any) -> None:
        pass

    def has_background_work(self) -> bool:
        return True

    def command_wait_ms(self) -> int:
        return 0

    def before_step(self, now_ns: int) -> None:
        pass

    def on_outputs(self, step: Any, step_end_ns: int) -> None:
        pass

    def load(self) -> LoadReport:
        return LoadReport(0, 0, 0, 0)


@contextmanager
def _paced_loop(pacing: bool) -> Iterator[tuple[WorkerLoop, Device, AwaitingRole, LaunchPacer]]:
    """The real WorkerLoop (real ZMQ sockets) over the simulated device and role."""
    paths = ipc.IpcPaths.fresh()
    ctx = zmq.Context()
    try:
        pull = ipc.bind_pull(ctx, paths.commands)
        reports, events = events_pair(paths.events)  # takes the loop's load reports
        dev = Device()
        role = AwaitingRole(dev)
        pacer = LaunchPacer(enabled=pacing)
        yield WorkerLoop(role, pull, events, pacer=pacer), dev, role, pacer  # type: ignore[arg-type]
    finally:
        ctx.destroy(linger=0)
        reports.close()
        paths.cleanup()


def _first_step_of_a_newcomer(pacing: bool) -> tuple[int, int, LaunchPacer]:
    """(index of the step the newcomer ran in, index of the step running when its KV
    landed, the pacer)."""
    with _paced_loop(pacing) as (loop, dev, role, pacer):
        for _ in range(4):  # steps 0..3 launched; the pacer has its means
            loop.turn()
        # the step now on the device is the last one launched; it started when the one
        # before it was read, just now. Land a fifth of the way into it.
        running = dev.launches - 1
        role.land_at = time.time() + STEP_S / 5
        while "new" not in dev.steps_with:
            loop.turn()
        return dev.steps_with["new"], running, pacer


def test_with_pacing_a_request_landing_mid_step_joins_the_next_launch() -> None:
    joined, running, pacer = _first_step_of_a_newcomer(pacing=True)
    assert joined == running + 1
    assert pacer.waits >= 1 and pacer.waited_s > STEP_S / 2


def test_without_pacing_it_waits_a_step_more() -> None:
    joined, running, pacer = _first_step_of_a_newcomer(pacing=False)
    assert joined == running + 2
    assert pacer.waits == 0


def test_the_device_never_idles_for_a_paced_launch() -> None:
    """Each paced launch still lands before the running step ends (margin >= 2 ms)."""
    with _paced_loop(True) as (loop, dev, _, pacer):  # the KV never lands: every turn paced
        late = []
        for _ in range(10):
            before = dev.free_at
            loop.turn()
            # the launch in this turn queued behind the running step: the device's next
            # free time moved by exactly one step unless the launch came after it
            late.append(dev.free_at - before - STEP_S)
        assert pacer.waits >= 6
        assert max(late[4:]) < MIN_MARGIN_S, late


def test_the_estimate_follows_shorter_steps_faster_than_longer_ones() -> None:
    """A step longer than the estimate (the device shared with a producer's prefill, a
    compile) moves it a little, at most 10% a step; shorter ones pull it down fast: late
    launches idle the device, early ones only cost a newcomer a step."""
    p = LaunchPacer()
    p.observe(_timing(0, 1, 0, 0))
    p.observe(_timing(2, 3, 1, 21))
    p.observe(_timing(22, 23, 3, 41))  # 20 ms
    p.observe(_timing(42, 43, 23, 101))  # one 60 ms step, counted as at most 2 x 20
    assert p.device_s is not None and abs(p.device_s - 0.022) < 1e-6  # 20 + 0.1 x 20
    p.observe(_timing(102, 103, 43, 111))  # then a 10 ms one (101..111)
    assert abs(p.device_s - 0.016) < 1e-6  # 22 - 0.5 x 12
    p.observe(_timing(112, 113, 103, 2111))  # a 2 s step (a compile): +10% at most
    assert abs(p.device_s - 0.0176) < 1e-6
