"""worker/loop_watch.LoopWatch: the loop's lag as the heartbeat process reads it, ticked by
a timer when the loop is idle and by the loop's own work (``poke``) when it is busy, so a
busy loop is not woken by the watch as well."""

from __future__ import annotations

import asyncio
import time

from worker.loop_watch import LoopWatch

TICK_S = 0.1


def _counting(watch: LoopWatch) -> list[float]:
    fired: list[float] = []
    fire = watch._fire

    def counted() -> None:
        fired.append(time.monotonic())
        fire()

    watch._fire = counted  # type: ignore[method-assign]
    return fired


def test_a_busy_loop_ticks_from_its_work_and_the_timer_never_wakes_it() -> None:
    async def main() -> None:
        watch = LoopWatch(lambda: None, tick_s=TICK_S)
        fired = _counting(watch)
        task = asyncio.create_task(watch.run())
        await asyncio.sleep(0)
        ticks = []
        end = time.monotonic() + 0.6
        while time.monotonic() < end:  # the engine's events, every 30 ms
            await asyncio.sleep(0.03)
            before = watch.ticked
            watch.poke()
            ticks.append(watch.ticked != before)
        assert fired == []  # moved on by every tick from the loop's work
        assert sum(ticks) >= 5  # about every other poke: at most every half period
        lag, _ = watch.read()
        assert lag < 0.05, lag
        task.cancel()

    asyncio.run(main())


def test_an_idle_loop_still_ticks_from_the_timer() -> None:
    async def main() -> None:
        watch = LoopWatch(lambda: None, tick_s=TICK_S)
        fired = _counting(watch)
        task = asyncio.create_task(watch.run())
        await asyncio.sleep(0.55)
        assert 4 <= len(fired) <= 6, fired
        assert watch.read()[0] < 0.05
        task.cancel()
        await asyncio.sleep(0)
        watch.poke()  # stopped: a poke does nothing (no timer to move)
        assert watch._timer is None

    asyncio.run(main())


def test_a_stalled_loop_shows_as_lag_whether_the_timer_or_work_ticks_next() -> None:
    async def main() -> None:
        watch = LoopWatch(lambda: None, tick_s=TICK_S)
        task = asyncio.create_task(watch.run())
        await asyncio.sleep(0.05)
        time.sleep(0.4)  # a callback holding the loop
        watch.poke()  # the next event after the stall ticks and sees it
        lag, _ = watch.read()
        assert 0.25 < lag < 0.5, lag
        time.sleep(0.4)  # stuck again: the heartbeat thread sees the overdue tick now
        lag, _ = watch.read()
        assert lag > 0.25, lag
        await asyncio.sleep(0.25)  # running again: the overdue timer's tick saw the stall
        assert watch.read()[0] > 0.25  # reported once (the worst since the last read)
        await asyncio.sleep(0.15)
        assert watch.read()[0] < 0.05  # and then it ticks on time
        task.cancel()

    asyncio.run(main())
