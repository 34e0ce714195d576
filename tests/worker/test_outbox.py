"""The engine process's events leave as one multipart ZMQ message per phase of a loop turn
(the commands' answers before the forward; the step's outputs, what after_step polled and
the load report after it), and the gRPC process routes such a message in one pass: a
step's reservation and tokens share one Outputs batch. Real ZMQ sockets, the real loop and
bridge; a recording role as the seam."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import zmq
import zmq.asyncio
from live_bridge import live_bridge

from engine.outputs import StepResult
from worker import ipc
from worker.engine_loop import WorkerLoop
from worker.load_report import LoadReport
from worker.messages import (
    AbortCmd,
    Command,
    Message,
    ReservedEvent,
    StatsEvent,
    decode,
    encode,
)
from worker.outbox import EventOutbox
from worker.token_batch import TokensBatchEvent, TokensEvent


class PhasedRole:
    """A busy engine whose role emits in each phase of a turn."""

    def __init__(self, outbox: EventOutbox) -> None:
        self.emit = outbox.emit
        self.engine = SimpleNamespace(has_unfinished=lambda: True, held_requests=lambda: [],
                                      step=lambda: StepResult(), drain_kv_events=lambda: [])

    def on_command(self, cmd: Command) -> None:
        assert isinstance(cmd, AbortCmd)
        self.emit(TokensEvent(cmd.rid, (), "", (), "abort", error="aborted"))

    def has_background_work(self) -> bool:
        return False

    def command_wait_ms(self) -> int:
        return 0

    def before_step(self, now_ns: int) -> None:
        pass

    def on_outputs(self, step: Any, step_end_ns: int) -> None:
        self.emit(TokensBatchEvent.of([TokensEvent("r2", (7,), "x", (), None)]))

    def after_step(self) -> None:
        self.emit(ReservedEvent("r3", "kv:1", (4, 5)))

    def load(self) -> LoadReport:
        return LoadReport(1, 2, 3, 4)


def _received(sock: zmq.Socket) -> list[list[Message]]:
    out = []
    while sock.poll(200):
        out.append([decode(p) for p in sock.recv_multipart()])
    return out


def test_a_turn_sends_one_message_before_the_forward_and_one_after() -> None:
    paths = ipc.IpcPaths.fresh()
    ctx = zmq.Context()
    try:
        # commands over inproc: a send lands in the pipe before it returns, so both aborts
        # are there for the turn (over ipc:// the second one could still be in flight on a
        # loaded machine, and the turn then took only the first)
        pull = ipc.bind_pull(ctx, "inproc://outbox-test-commands")
        push = ipc.connect_push(ctx, "inproc://outbox-test-commands")
        ev_pull = ipc.bind_pull(ctx, paths.events)
        events = ipc.connect_push(ctx, paths.events)
        outbox = EventOutbox(events)
        loop = WorkerLoop(PhasedRole(outbox), pull, events, outbox)  # type: ignore[arg-type]
        push.send(encode(AbortCmd("r1")))
        push.send(encode(AbortCmd("r0")))
        assert pull.poll(2000)
        loop.turn()
        got = _received(ev_pull)
        assert len(got) == 2
        assert got[0] == [TokensEvent("r1", (), "", (), "abort", error="aborted"),
                          TokensEvent("r0", (), "", (), "abort", error="aborted")]
        tokens, reserved, stats = got[1]
        assert isinstance(tokens, TokensBatchEvent)
        assert tokens.events() == (TokensEvent("r2", (7,), "x", (), None),)
        assert reserved == ReservedEvent("r3", "kv:1", (4, 5))
        assert isinstance(stats, StatsEvent) and stats.load.waiting == 1
        loop.turn()  # no command, and the load report is not due: only the step's outputs
        [[again, reserved_again]] = _received(ev_pull)
        assert isinstance(again, TokensBatchEvent) and again.rids == ["r2"]
        assert reserved_again == reserved
    finally:
        ctx.destroy(linger=0)
        paths.cleanup()


def test_a_steps_reservation_and_tokens_leave_in_one_outputs_batch() -> None:
    async def main() -> None:
        async with live_bridge() as (bridge, push, pump):
            sub, _ = bridge.hub.subscribe("router-a")
            bridge.hub.attach("r1", sub)
            bridge.hub.attach("r2", sub)
            await push.send_multipart([
                encode(ReservedEvent("r2", "kv:9", (1, 2, 3))),
                b"not msgpack \xc1",  # a bad part is dropped; the rest of the message routes
                encode(TokensBatchEvent.of([TokensEvent("r1", (5,), "a", (), None),
                                            TokensEvent("r2", (6, 8), "bc", (), "stop")])),
                encode(StatsEvent(LoadReport(4, 0, 0, 0)))])
            batch = await asyncio.wait_for(sub.next_batch(), 5)
            assert batch.seq == 1
            assert [(r.request_id, list(r.block_ids)) for r in batch.reserved] == [
                ("r2", [1, 2, 3])]
            assert [(t.request_id, list(t.token_ids), t.text) for t in batch.tokens] == [
                ("r1", [5], "a"), ("r2", [6, 8], "bc")]
            assert bridge.load == LoadReport(4, 0, 0, 0)
            assert not bridge.hub.owns("r2") and bridge.hub.owns("r1")

    asyncio.run(main())
