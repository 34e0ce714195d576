"""Launches a deferred-output step late, so that requests whose KV lands while the device
runs the step before it still join it.

Why: with overlap scheduling, one engine.step() call launches step N+1 and then reads step
N's ids, which returns when N ends and N+1 starts on the device; the loop's next turn at
once schedules and launches N+2, which queues behind N+1. A P/D consumer polls its KV
transfers once a turn, right after that read, so a request whose KV lands while N+1 runs
misses N+2 (already scheduled) and joins N+3: its first gap (token 0 -> token 1) holds two
whole decode steps besides the transfer. On one H200 at 12.5 ms steps that was 25 ms of a
35-45 ms first gap (bench/itl_split.py, bench/RESULTS.md, session 18).

So while KV transfers are in flight, the loop waits (still taking commands) until shortly
before the step on the device is expected to end, polls the transfers again, and only then
schedules and launches the next step: a request whose KV landed in the meantime joins it.
The device stays busy as long as the launch lands before the running step ends: the wait
ends `margin` plus the host's own launch time ahead of the expected end. Expected ends come
from the device time of recent steps, measured from the engine's marks
(engine/step_timing.py), never from the loop's period, which a late launch would
itself lengthen.

Without transfers in flight (nothing could join), without a step on the device, or before
the first measurements, the loop launches at once as before.
"""

from __future__ import annotations

from engine.step_timing import StepTiming

# Weight of the newest sample in the running means (steps of one batch size are steady;
# a batch that grows moves the mean within a few steps).
EMA = 0.25
# The device-time estimate falls fast and rises slowly, so it sits low in the spread of
# recent steps: launching early only lets a newcomer miss the step (as without pacing),
# launching late idles the device. On one H200 shared by P and D the consumer's steps
# vary with the producer's prefills beside them; with one symmetric mean (EMA for both)
# the seeds' TPOT p50 was 13.2 ms paced against 12.3 unpaced (bench/RESULTS.md).
EMA_DOWN = 0.5
EMA_UP = 0.1
# A sample counts as at most this many times the estimate: a one-off long step (a Triton
# compile, a collection, a local prefill's mixed step) would otherwise raise it enough to
# idle the device for several steps while it falls back.
MAX_RISE = 2.0
# The launch lands this long (plus the host's launch time) before the expected end: host
# jitter of a millisecond or two must not leave the device idle.
MIN_MARGIN_S = 0.002
# ... or this fraction of a step, when steps are long (their time varies more in absolute
# terms).
MARGIN_FRACTION = 0.15
# No waiting behind steps shorter than this: the step itself is the delay a newcomer sees,
# and the host's jitter is a larger share of it.
MIN_STEP_S = 0.004
# A read that returned sooner than this after the launch before it found its step done.
READ_WAITED_NS = 300_000


class LaunchPacer:
    def __init__(self, enabled: bool = True) -> None:
        self.enabled = enabled
        self.device_s: float | None = None  # mean device time of a step
        self.launch_s: float | None = None  # mean host time from step() entry to launch
        self._last_read_ns = 0
        self._running_since_ns = 0  # when the step now on the device started (0: none)
        self.waits = 0  # turns that waited, and their total wait (read by the tests)
        self.waited_s = 0.0

    def wait_s(self, now_ns: int, has_inflight: bool, awaiting_kv: bool) -> float:
        """How long to wait before launching the next step (0: launch now)."""
        if (not self.enabled or not has_inflight or not awaiting_kv or not self._running_since_ns
                or self.device_s is None or self.launch_s is None
                or self.device_s < MIN_STEP_S):
            return 0.0
        margin = max(MIN_MARGIN_S, MARGIN_FRACTION * self.device_s)
        launch_at = self._running_since_ns / 1e9 + self.device_s - self.launch_s - margin
        return max(0.0, launch_at - now_ns / 1e9)

    def waited(self, seconds: float) -> None:
        if seconds > 0:
            self.waits += 1
            self.waited_s += seconds

    def observe(self, t: StepTiming) -> None:
        """After each engine.step(): its marks update the means and the running step."""
        if t.read_ns:
            # The step read ran on the device from when it could start (its predecessor's
            # read, or its own launch if later) to its read: a sample only when the read
            # waited for the device. A read that found the step long done (the host came
            # late: a collection, a slow turn) says when the host came, and counting it as
            # device time would push the next launch later, idling the device, and so on.
            start = max(self._last_read_ns, t.read_launched_ns)
            waited = t.read_ns - max(t.launched_ns, t.entered_ns) > READ_WAITED_NS
            if self._last_read_ns and waited and t.read_ns > start:
                self.device_s = _low_mean(self.device_s, (t.read_ns - start) / 1e9)
            self._last_read_ns = t.read_ns
        if t.launched_ns:
            self.launch_s = _mean(self.launch_s, max(0, t.launched_ns - t.entered_ns) / 1e9)
            # The step just launched starts when the one read in this call ended, or at
            # its launch if that was later (the device was idle).
            self._running_since_ns = max(t.launched_ns, t.read_ns or t.launched_ns)
        else:
            self._running_since_ns = 0


def _mean(old: float | None, new: float) -> float:
    return new if old is None else old + EMA * (new - old)


def _low_mean(old: float | None, new: float) -> float:
    """A running mean that follows falls faster than rises (EMA_DOWN, EMA_UP), and a rise
    of at most MAX_RISE times itself per sample."""
    if old is None:
        return new
    if new < old:
        return old + EMA_DOWN * (new - old)
    return old + EMA_UP * (min(new, MAX_RISE * old) - old)
