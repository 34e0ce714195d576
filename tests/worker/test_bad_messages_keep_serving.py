"""A malformed message on the worker's IPC link is dropped: the engine loop and the gRPC
process's event pump both keep going (real ZMQ sockets; a recording role as the seam)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import zmq
from event_link_pair import events_pair
from live_bridge import live_bridge

from engine.outputs import StepResult
from worker import ipc
from worker.engine_loop import WorkerLoop
from worker.load_report import LoadReport
from worker.messages import AbortCmd, Command, StatsEvent, StopCmd, encode
from worker.token_batch import TokensEvent


class RecordingRole:
    def __init__(self) -> None:
        self.engine = SimpleNamespace(has_unfinished=lambda: False, held_requests=lambda: [],
                                      defers_output=True,
                                      drain_kv_events=lambda: [])
        self.commands: list[Command] = []

    def on_command(self, cmd: Command) -> None:
        self.commands.append(cmd)

    def has_background_work(self) -> bool:
        return False

    def command_wait_ms(self) -> int:
        # asked whenever a turn ends with the loop still running (a command arriving after
        # the turn's first drain, as under load)
        return 0

    def after_step(self) -> None:
        pass

    def load(self) -> LoadReport:
        return LoadReport(0, 0, 0, 0)


def test_engine_loop_drops_bad_commands_and_keeps_running() -> None:
    paths = ipc.IpcPaths.fresh()
    ctx = zmq.Context()
    try:
        pull = ipc.bind_pull(ctx, paths.commands)
        push = ipc.connect_push(ctx, paths.commands)
        reports, events = events_pair(paths.events)  # takes the loop's load reports
        role = RecordingRole()
        loop = WorkerLoop(role, pull, events)  # type: ignore[arg-type]
        for data in (b"\xc1", encode(AbortCmd("a")), b"\x92\xa5abort",
                     encode(StatsEvent(LoadReport(0, 0, 0, 0))), encode(AbortCmd("b")),
                     encode(StopCmd())):
            push.send(data)
        for _ in range(100):
            if not loop.running:
                break
            loop.turn()
        assert role.commands == [AbortCmd("a"), AbortCmd("b")]
        assert not loop.running
    finally:
        ctx.destroy(linger=0)
        reports.close()
        paths.cleanup()


def test_bridge_pump_drops_bad_events_and_keeps_routing() -> None:
    async def main() -> None:
        async with live_bridge() as (bridge, push, pump):
            q = bridge.open("r1")
            for data in (b"not msgpack \xc1", encode(AbortCmd("r1")),
                         b"\x93\xa6tokens\xa2r1\x01", encode(StatsEvent(LoadReport(4, 0, 0, 0))),
                         encode(TokensEvent("r1", (5,), "x", (), "stop"))):
                await push.send(data)
            got = await asyncio.wait_for(q.get(), 5)
            assert got == TokensEvent("r1", (5,), "x", (), "stop")
            assert bridge.load == LoadReport(4, 0, 0, 0)
            assert not pump.done()

    asyncio.run(main())


class WaitingRole(RecordingRole):
    """A busy engine whose role expects one command before its next step."""

    def __init__(self) -> None:
        super().__init__()
        self.order: list[str] = []
        self.engine = SimpleNamespace(has_unfinished=lambda: True, held_requests=lambda: [],
                                      defers_output=True,
                                      step=lambda: self.order.append("step") or StepResult(),
                                      drain_kv_events=lambda: [])

    def on_command(self, cmd: Command) -> None:
        self.order.append("command")
        super().on_command(cmd)

    def command_wait_ms(self) -> int:
        return 0 if self.commands else 5000

    def before_step(self, now_ns: int) -> None:
        pass

    def on_outputs(self, outs: Any, step_end_ns: int) -> None:
        pass


def test_engine_loop_holds_the_next_step_for_a_command_the_role_awaits() -> None:
    """The producer's final transfer notice waits for a Token0SentCmd that arrives a moment
    after token 0: the loop must apply it before launching the next (long) step."""
    import threading

    paths = ipc.IpcPaths.fresh()
    ctx = zmq.Context()
    try:
        pull = ipc.bind_pull(ctx, paths.commands)
        push = ipc.connect_push(ctx, paths.commands)
        reports, events = events_pair(paths.events)
        role = WaitingRole()
        loop = WorkerLoop(role, pull, events)  # type: ignore[arg-type]
        later = threading.Timer(0.05, lambda: push.send(encode(AbortCmd("a"))))
        later.start()
        loop.turn()
        later.join()
        assert role.order == ["command", "step"]
    finally:
        ctx.destroy(linger=0)
        reports.close()
        paths.cleanup()
