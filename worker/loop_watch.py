"""How far behind a worker's gRPC event loop runs, and the engine's latest load, posted on
the shared board (worker/load_board.py) that the heartbeat process reads."""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import time
from collections.abc import Callable

from pdserve.v1 import common_pb2

from worker.load_board import LOAD_MAX, LoadBoard, new_raw
from worker.load_report import LoadReport

# The loop's ticker period: the resolution of the reported lag, at ten cheap wakeups a second.
TICK_S = 0.1


def load_pb(r: LoadReport | None) -> common_pb2.WorkerLoad:
    """The heartbeat's view of the engine's latest report (None before the first: empty)."""
    if r is None:
        return common_pb2.WorkerLoad()
    return common_pb2.WorkerLoad(
        waiting=r.waiting, running=r.running, kv_blocks_free=r.kv_blocks_free,
        kv_blocks_total=r.kv_blocks_total, transfers_in_flight=r.transfers_in_flight,
        kv_exhausted_by_orphans=r.kv_exhausted_by_orphans,
        dp_ranks=[common_pb2.DPRankLoad(waiting=d.waiting, running=d.running,
                                        kv_blocks_free=d.kv_blocks_free,
                                        kv_blocks_total=d.kv_blocks_total)
                  for d in r.dp_ranks])


def _fitting(pb: common_pb2.WorkerLoad) -> bytes:
    """The report as the board can hold it: a worker of thousands of data-parallel groups
    (none today) would lose its per-group rows, not its ticks (a tick that raised would end
    the ticker, and the router would see the loop stuck)."""
    raw = pb.SerializeToString()
    if len(raw) > LOAD_MAX:
        del pb.dp_ranks[:]
        raw = pb.SerializeToString()
    return raw


class LoopWatch:
    """How far behind an event loop runs, for a heartbeat sent from elsewhere.

    ``tick`` runs on the loop every ``tick_s``: from a timer, or from ``poke`` (the loop's own
    work arriving, such as the engine's events), which then moves the timer on. So a busy
    loop ticks without a wake-up of its own: a timer's wake-up of an otherwise idle loop
    cost ~0.3 ms of CPU on a 2-core VM, and ten a second were a quarter of a consumer's gRPC
    process at 1k tokens/s. Each tick posts on the board: when it ran, how late it was, the
    engine report's age and (when a new one came) the report itself. The reader
    (``LoadBoard.read``, the heartbeat process) then sees a loop that is stuck now (its tick
    overdue) as well as one that was stuck since the last read and caught up (the worst
    lateness a tick saw). The engine process's reports arrive on the same loop
    (``EngineBridge.pump`` keeps the latest, a new object each time), so their age is taken
    in loop time, at each tick: a stalled loop shows as loop lag, not as a stale engine.
    ``on_tick`` runs after each tick (the registration's check for a failed engine).
    """

    def __init__(self, load: Callable[[], LoadReport | None], tick_s: float = TICK_S,
                 clock: Callable[[], float] = time.monotonic,
                 board: LoadBoard | None = None,
                 on_tick: Callable[[], None] = lambda: None) -> None:
        self.tick_s = tick_s
        self._clock = clock
        self._load = load
        if board is None:  # nobody else reads it (the watch's own tests)
            board = LoadBoard(new_raw(mp.get_context("spawn")), clock)
        self.board = board
        self.on_tick = on_tick
        self.ticked = clock()  # when the loop last ran its tick
        self._seen: object = None
        self._seen_at = self.ticked
        self.engine_age = 0.0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._timer: asyncio.TimerHandle | None = None
        self.board.tick(tick_s, self.ticked, 0.0, 0.0, load_pb(None).SerializeToString())

    async def run(self) -> None:
        """Ticks until cancelled."""
        self._loop = asyncio.get_running_loop()
        self._arm()
        try:
            await self._loop.create_future()
        finally:
            if self._timer is not None:
                self._timer.cancel()
            self._loop = self._timer = None

    def _arm(self) -> None:
        assert self._loop is not None
        self._timer = self._loop.call_later(self.tick_s, self._fire)

    def _fire(self) -> None:
        self.tick()
        self._arm()

    def poke(self) -> None:
        """The loop is running other work now: tick here (at most every half period, so a
        busy loop pays for it a few times a tick) and move the timer on."""
        if self._timer is None or self._clock() - self.ticked < self.tick_s / 2:
            return
        self._timer.cancel()
        self.tick()
        self._arm()

    def tick(self) -> None:
        now = self._clock()
        late = max(0.0, now - self.ticked - self.tick_s)
        self.ticked = now
        load = self._load()
        fresh: bytes | None = None
        if load is not self._seen:  # a new report (each one is a new object)
            self._seen, self._seen_at = load, now
            fresh = _fitting(load_pb(load))
        else:  # the reports waiting behind a stalled loop are not the engine's delay
            self._seen_at = min(now, self._seen_at + late)
        self.engine_age = now - self._seen_at
        self.board.tick(self.tick_s, now, late, self.engine_age, fresh)
        self.on_tick()

    def read(self) -> tuple[float, float]:
        """(loop lag, engine report age) in seconds, as the next heartbeat will say them."""
        lag, age, _ = self.board.read()
        return lag, age
