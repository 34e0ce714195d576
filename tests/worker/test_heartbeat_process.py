"""A worker whose gRPC process is blocked keeps heartbeating.

The worker's heartbeats leave from their own process (worker/heartbeat_process.py), so a
loop saturated by token streams, here blocked outright for 4 s (4x the router's heartbeat
timeout), delays none of them: the router keeps the worker, and hears from the same
heartbeats how far behind the loop is (busy, not dead). Before, the heartbeats ran on that
loop: the router dropped the worker after 1 s and failed every request on it.

Real parts: the worker's ``Registration`` (its heartbeat process, the loop's ticker and the
shared board) and a real ``RouterServer`` (registry, sweep) on its own loop in another
thread.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import subprocess
import sys
import threading
import time
from typing import Any

import pytest
from pdserve.v1 import common_pb2, worker_pb2

from deploy.benchmark.proc_cpu import HEARTBEAT_COMM, role_of
from engine.model_source import resolve_model
from engine.tokenizer import Tokenizer
from router.config import RouterConfig
from router.server import RouterServer
from worker.heartbeat_process import PROCESS_NAME, Heartbeater, HeartbeatSpec, router_channel
from worker.load_report import LoadReport
from worker.messages import ReadyInfo
from worker.registration import Registration

INFO = ReadyInfo("smollm2", "fp", 256, kv_address="tcp://127.0.0.1:1")
INTERVAL_S, TIMEOUT_S = 0.2, 1.0


class RouterThread:
    """A real router on its own event loop, so the test's loop can block without it."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.server = RouterServer(
            RouterConfig(grpc_port=0, heartbeat_interval_s=INTERVAL_S,
                         heartbeat_timeout_s=TIMEOUT_S, busy_lag_s=1.0,
                         busy_engine_s=1.0),
            tokenizer=Tokenizer.from_source(resolve_model(None)))
        self.beats: list[common_pb2.WorkerLoad] = []  # every heartbeat's load, as received
        self.dropped: list[str] = []

    def __enter__(self) -> RouterThread:
        self.thread.start()
        asyncio.run_coroutine_threadsafe(self.server.start(), self.loop).result(30)
        reg = self.server.registry
        assert reg is not None
        beat = reg.heartbeat

        def recording(worker_id: str, load: common_pb2.WorkerLoad | None) -> bool:
            if load is not None:
                self.beats.append(common_pb2.WorkerLoad.FromString(load.SerializeToString()))
            return beat(worker_id, load)

        reg.heartbeat = recording  # type: ignore[method-assign]
        reg.on_drop.append(lambda w, why: self.dropped.append(why))
        return self

    def __exit__(self, *exc: object) -> None:
        asyncio.run_coroutine_threadsafe(self.server.stop(0), self.loop).result(30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()

    def call(self, fn: Any, *args: Any) -> Any:
        """fn(*args) on the router's loop (its registry is that loop's)."""
        async def on_loop() -> Any:
            return fn(*args)

        return asyncio.run_coroutine_threadsafe(on_loop(), self.loop).result(10)


async def _until(cond: Any, timeout_s: float = 10.0) -> None:
    end = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < end, "timed out"
        await asyncio.sleep(0.02)


@pytest.mark.slow
def test_a_blocked_worker_loop_is_busy_not_dead() -> None:
    with RouterThread() as router:
        registry = router.server.registry
        assert registry is not None

        async def main() -> None:
            report: list[LoadReport | None] = [None]

            async def engine_reports() -> None:  # as EngineBridge.pump: a new report each time
                while True:
                    report[0] = LoadReport(0, 0, kv_blocks_free=10, kv_blocks_total=10)
                    await asyncio.sleep(0.25)

            reports = asyncio.create_task(engine_reports())
            reg = Registration(router.server.address, "worker-1", "consumer", "127.0.0.1:1",
                               INFO, lambda: report[0])
            task = asyncio.create_task(reg.run())
            try:
                await _until(lambda: router.call(registry.get, "worker-1") is not None)
                first = router.call(registry.get, "worker-1")
                await asyncio.sleep(3 * INTERVAL_S)
                n = len(router.beats)
                time.sleep(4.0)  # the loop is blocked: 4x the router's heartbeat timeout
                during = router.beats[n:]
                assert router.dropped == []  # before: dropped after 1 s, requests failed
                assert router.call(registry.get, "worker-1") is first
                assert len(during) >= 10, len(during)  # the beats went on every 0.2 s
                # ... saying how far behind the loop was: the router saw it busy
                lags = [b.loop_lag_s for b in during]
                assert max(lags) > 3.0 and lags == sorted(lags), lags
                assert first.busy_reason(1.0, 1.0).startswith("its event loop is")
                assert not router.call(registry.placeable, common_pb2.ROLE_CONSUMER)
                # the loop runs again: the next heartbeats say so (the worst lag since the
                # last heartbeat first, then the present)
                await _until(lambda: not first.busy_reason(1.0, 1.0), timeout_s=5)
                assert router.beats[-1].loop_lag_s < 1.0
                assert max(b.engine_report_age_s for b in router.beats) < 1.0
                # an engine whose reports stop (a step that never ends) is busy too, while
                # the loop keeps up
                reports.cancel()
                await _until(lambda: first.load.engine_report_age_s > 1.0, timeout_s=5)
                assert first.busy_reason(1.0, 1.0).startswith("its engine's last load report is")
                assert router.beats[-1].loop_lag_s < 1.0
                # orders from the router still reach the loop (over the process's pipe)
                router.call(registry.order_role_change, "worker-1", common_pb2.ROLE_PRODUCER)
                await asyncio.wait_for(reg.ordered.wait(), 5)
                assert reg.change_role == common_pb2.ROLE_PRODUCER
                assert router.dropped == [] and router.call(registry.get, "worker-1") is first
            finally:
                reports.cancel()
                task.cancel()
                await reg.close()
            assert reg._proc is not None and reg._proc.exitcode == 0  # closed: it ended

        asyncio.run(main())


def test_a_refused_worker_raises_from_run() -> None:
    """The heartbeat process's verdict reaches the loop: run() raises the router's
    refusal."""
    with RouterThread() as router:
        async def main() -> None:
            reg = Registration(router.server.address, "worker-1", "consumer", "127.0.0.1:1",
                               dataclasses.replace(INFO, model="another-model"), lambda: None)
            try:
                with pytest.raises(RuntimeError, match="the router refused this worker: model:"):
                    await asyncio.wait_for(reg.run(), 10)
            finally:
                await reg.close()

        asyncio.run(main())


def test_slow_heartbeats_keep_their_cadence() -> None:
    """A heartbeat that takes most of an interval to send (a router or a network under load)
    does not push the next one back by its own duration: beats start every interval, so the
    router's gaps stay near the interval, not interval + call. ``Heartbeater`` (the heartbeat
    process's loop) on a thread, with a load that is slow to build."""
    with RouterThread() as router:
        registry = router.server.registry
        assert registry is not None
        slow = 0.75 * INTERVAL_S

        def slow_load() -> common_pb2.WorkerLoad:
            time.sleep(slow)
            return common_pb2.WorkerLoad(kv_blocks_free=10, kv_blocks_total=10)

        told: list[tuple[Any, ...]] = []
        stop = threading.Event()
        channel = router_channel(router.server.address, "")
        spec = HeartbeatSpec(router.server.address, "", "worker-1", "consumer", "",
                             worker_pb2.RegisterRequest(
                                 worker_id="worker-1", role=common_pb2.ROLE_CONSUMER,
                                 address="127.0.0.1:1", kv_address=INFO.kv_address,
                                 model=INFO.model, kv_fingerprint=INFO.kv_fingerprint,
                                 max_model_len=INFO.max_model_len).SerializeToString())
        hb = Heartbeater(channel, spec, slow_load, told.append)
        beats = threading.Thread(target=hb.run, args=(stop.wait,), daemon=True)
        beats.start()
        try:
            end = time.monotonic() + 10
            while router.call(registry.get, "worker-1") is None:
                assert time.monotonic() < end, (told, "never registered")
                time.sleep(0.02)
            assert hb.interval == INTERVAL_S and told == []  # the router's interval taken
            n = len(router.beats)
            time.sleep(12 * INTERVAL_S)
            got = len(router.beats) - n
            # on the interval's cadence ~12; one interval after each call ended, ~7
            assert got >= 10, got
        finally:
            stop.set()
            beats.join(10)
            channel.close()
        assert not beats.is_alive()



WORKER = """
import asyncio, sys
from worker.messages import ReadyInfo
from worker.registration import Registration

async def main():
    reg = Registration(sys.argv[1], "worker-1", "consumer", "127.0.0.1:1",
                       ReadyInfo("smollm2", "fp", 256, kv_address="tcp://127.0.0.1:1"),
                       lambda: None)
    task = asyncio.create_task(reg.run())
    while reg._proc is None:
        await asyncio.sleep(0.01)
    print(reg._proc.pid, flush=True)
    await task

asyncio.run(main())
"""


def test_a_killed_worker_takes_its_heartbeat_process_along() -> None:
    """SIGKILL to the worker's gRPC process alone (the OOM killer): its heartbeat process
    dies with it (parent-death signal) and the router drops the worker at its timeout. A
    heartbeat process left behind would tell the router, for good, that a dead worker
    lives."""
    with RouterThread() as router:
        registry = router.server.registry
        assert registry is not None
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
        worker = subprocess.Popen([sys.executable, "-c", WORKER, router.server.address],
                                  stdout=subprocess.PIPE, env=env, text=True)
        try:
            assert worker.stdout is not None
            beats_pid = int(worker.stdout.readline())
            end = time.monotonic() + 20
            while router.call(registry.get, "worker-1") is None:
                assert time.monotonic() < end, "never registered"
                time.sleep(0.02)
            assert _alive(beats_pid)
            # named, so the serving bench's CPU meter (and ps) tell it from the engine
            assert role_of(beats_pid, worker.pid, "worker-1") == "heartbeat"
            assert HEARTBEAT_COMM == PROCESS_NAME.decode()
            worker.kill()
            worker.wait(10)
            end = time.monotonic() + 5
            while _alive(beats_pid):
                assert time.monotonic() < end, "the heartbeat process outlived its worker"
                time.sleep(0.02)
            end = time.monotonic() + 5 * TIMEOUT_S
            while router.call(registry.get, "worker-1") is not None:
                assert time.monotonic() < end, "the router still has the dead worker"
                time.sleep(0.05)
            assert router.dropped and "stopped heartbeating" in router.dropped[0]
        finally:
            worker.kill()
            worker.wait(10)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"  # a zombie is dead
    except FileNotFoundError:
        return False


def test_a_closed_registration_leaves_the_loop_clean_for_the_next() -> None:
    """A role change closes the worker's registration and starts the next role's servers on
    the same loop. The pipe to the heartbeat process was once closed before its reader was
    removed: the loop kept a reader on a dead fd number, the next listener to get that
    number failed ("the handler is closed"; EEXIST from the selector), and the worker never
    came back in its new role."""
    async def role(loop: asyncio.AbstractEventLoop) -> None:
        reg = Registration("127.0.0.1:1", "worker-1", "consumer", "127.0.0.1:1", INFO,
                           lambda: None)
        task = asyncio.create_task(reg.run())
        await _until(lambda: reg._conn is not None)
        fd = reg._conn.fileno()
        task.cancel()  # as WorkerServer.stop: the tasks first, then close()
        await reg.close()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert fd not in loop._selector.get_map()  # type: ignore[attr-defined]
        # the next role's listener, likely on the same fd number, serves
        got: list[bytes] = []

        async def serve(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
            got.append(await r.read(2))
            w.close()

        server = await asyncio.start_server(serve, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        _, w = await asyncio.open_connection("127.0.0.1", port)
        w.write(b"hi")
        await w.drain()
        await _until(lambda: got == [b"hi"], timeout_s=5)
        w.close()
        server.close()
        await server.wait_closed()

    async def main() -> None:
        for _ in range(2):  # a role change, then another
            await role(asyncio.get_running_loop())

    asyncio.run(main())
