"""Counts the engine process's steps, so a worker's speed is visible from outside it.

Why: on a GPU a decode step is a few milliseconds, mostly the host waiting, so a worker
that steps slower than another with the same engine (a P/D consumer next to a colocated
worker) loses its time in the host: in the step call itself, or between steps (commands,
the role's hooks, transfer polling, threads competing for the GIL). These counters split
the two: ``step_s`` is the wall time inside ``engine.step()``; ``gap_s`` is the time from
the end of one step call to the start of the next, counted only when the loop stepped on
consecutive turns (an idle wait is not overhead). Cumulative totals travel with every load
report (Prometheus counters on /metrics; means are ratios of rates); ``window_line`` gives
a log line per window while the worker is busy, so a benchmark's logs show each worker's
mean batch and step time without a scrape.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from engine.outputs import RequestOutput
from worker.load_report import StepCounters

LOG_EVERY_S = 10.0


class StepStats:
    def __init__(self, clock: Callable[[], float] = time.perf_counter) -> None:
        self.clock = clock
        self.steps = 0  # engine.step() calls
        self.rows = 0  # requests that got tokens from them (their mean: the batch size)
        self.tokens = 0  # tokens those steps reported
        self.step_s = 0.0  # wall seconds inside engine.step()
        self.gap_s = 0.0  # wall seconds between consecutive step calls
        self.gaps = 0  # how many gaps gap_s sums (steps that followed a step)
        self._started = 0.0
        self._ended: float | None = None  # end of the last step, None after an idle turn
        # the window's longest step and gap: a mean hides the stall a client sees as a
        # long inter-token gap
        self._max_step = 0.0
        self._max_gap = 0.0
        self._window: tuple[float, int, int, float, float, int] | None = None

    def start(self) -> None:
        """Right before ``engine.step()``."""
        now = self.clock()
        if self._ended is not None:
            self.gap_s += now - self._ended
            self.gaps += 1
            self._max_gap = max(self._max_gap, now - self._ended)
        self._started = now

    def end(self, outs: list[RequestOutput]) -> None:
        """Right after ``engine.step()`` returned ``outs``."""
        now = self.clock()
        self.step_s += now - self._started
        self._max_step = max(self._max_step, now - self._started)
        self.steps += 1
        for out in outs:
            if out.new_token_ids:
                self.rows += 1
                self.tokens += len(out.new_token_ids)
        self._ended = now

    def idle(self) -> None:
        """A turn that did not step: the next step's wait is not counted as a gap."""
        self._ended = None

    def counters(self) -> StepCounters:
        """For the load report (worker/metrics_server.py turns them into counters)."""
        return StepCounters(self.steps, self.rows, self.tokens, self.step_s, self.gap_s,
                            self.gaps)

    def window_line(self, now: float | None = None, every_s: float = LOG_EVERY_S,
                    gc_pause_s: float | None = None) -> str | None:
        """A summary of the steps since the last line, once ``every_s`` has passed and the
        window had steps; None otherwise (an idle worker logs nothing). gc_pause_s: the
        window's longest garbage-collection pause, shown beside the longest step and gap."""
        now = self.clock() if now is None else now
        snap = (now, self.steps, self.rows, self.step_s, self.gap_s, self.gaps)
        if self._window is None:
            self._window = snap
            return None
        t0, steps0, rows0, step0, gap0, gaps0 = self._window
        if now - t0 < every_s:
            return None
        self._window = snap
        steps = self.steps - steps0
        max_step, max_gap = self._max_step, self._max_gap
        self._max_step = self._max_gap = 0.0
        if steps == 0:
            return None
        gaps = self.gaps - gaps0
        gap_ms = 1e3 * (self.gap_s - gap0) / gaps if gaps else 0.0
        step_ms = 1e3 * (self.step_s - step0) / steps
        line = (f"steps: {steps} in {now - t0:.1f} s, mean batch "
                f"{(self.rows - rows0) / steps:.2f}, step {step_ms:.2f} ms "
                f"(max {1e3 * max_step:.1f}), between steps {gap_ms:.2f} ms "
                f"(max {1e3 * max_gap:.1f})")
        if gc_pause_s is not None:
            line += f", longest gc pause {1e3 * gc_pause_s:.1f} ms"
        return line
