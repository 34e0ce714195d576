"""The worker's gRPC process learns that its engine process exited from the process's
sentinel (no poll): it fails the requests still open and raises with the exit code, and it
spends nothing on the watch while the engine runs. Real parts: a spawned process."""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import time

import pytest

from worker.server import WorkerConfig, WorkerServer


def _exit_after(delay_s: float, code: int) -> None:
    time.sleep(delay_s)
    raise SystemExit(code)


def _server() -> WorkerServer:
    return WorkerServer(WorkerConfig(spec=None, servicer=None, router="127.0.0.1:1"))  # type: ignore[arg-type]


def test_an_engine_that_exits_is_seen_at_once_with_its_exit_code() -> None:
    async def main() -> tuple[str, float]:
        server = _server()
        server.proc = mp.get_context("spawn").Process(target=_exit_after, args=(1.0, 7))
        server.proc.start()
        t0 = time.monotonic()
        try:
            with pytest.raises(RuntimeError) as e:
                await asyncio.wait_for(server._watch_engine(), 30)
        finally:
            server.proc.join(5)
        return str(e.value), time.monotonic() - t0

    error, took = asyncio.run(main())
    assert error.endswith("engine process exited (exit code 7)")
    assert 0.9 <= took < 10  # the exit, not a timeout


def test_watching_a_running_engine_takes_no_wakeups() -> None:
    """While the engine runs, the loop has no timer of the watch's (a poll would keep one
    armed); cancelling the watch (shutdown) removes its reader."""

    async def main() -> tuple[int, int]:
        loop = asyncio.get_running_loop()
        server = _server()
        server.proc = mp.get_context("spawn").Process(target=_exit_after, args=(30.0, 0))
        server.proc.start()
        try:
            task = asyncio.create_task(server._watch_engine())
            await asyncio.sleep(0.5)
            timers = len(loop._scheduled)  # type: ignore[attr-defined]
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            readers = len(loop._selector.get_map())  # type: ignore[attr-defined]
            return timers, readers
        finally:
            server.proc.kill()
            server.proc.join(5)

    timers, readers = asyncio.run(main())
    assert timers == 0
    assert readers == 1  # only the loop's own self-pipe
