"""The engine process's events leave as one message on the events link per phase of a loop turn
(the commands' answers before the forward; the step's outputs, what after_step polled and
the load report after it), and the gRPC process routes such a message in one pass: a
step's reservation and tokens share one Outputs batch. Real sockets, the real loop and
bridge; a recording role as the seam."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import zmq
import zmq.asyncio
from event_link_pair import events_pair, received
from live_bridge import live_bridge

from engine.outputs import StepResult
from worker import ipc
from worker.engine_loop import WorkerLoop
from worker.event_link import EventReader
from worker.load_report import LoadReport
from worker.messages import (
    AbortCmd,
    Command,
    Message,
    ReservedEvent,
    StatsEvent,
    Token0Event,
    decode,
    encode,
)
from worker.outbox import EventOutbox
from worker.output_hub import Token0Routed
from worker.token_batch import TokensBatchEvent, TokensEvent


class PhasedRole:
    """A busy engine whose role emits in each phase of a turn."""

    def __init__(self, outbox: EventOutbox) -> None:
        self.emit = outbox.emit
        self.engine = SimpleNamespace(has_unfinished=lambda: True, held_requests=lambda: [],
                                      defers_output=True,
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


def _received(reader: EventReader) -> list[list[Message]]:
    return [[decode(p) for p in parts] for parts in received(reader)]


def test_a_turn_sends_one_message_before_the_forward_and_one_after() -> None:
    paths = ipc.IpcPaths.fresh()
    ctx = zmq.Context()
    try:
        # commands over inproc: a send lands in the pipe before it returns, so both aborts
        # are there for the turn (over ipc:// the second one could still be in flight on a
        # loaded machine, and the turn then took only the first)
        pull = ipc.bind_pull(ctx, "inproc://outbox-test-commands")
        push = ipc.connect_push(ctx, "inproc://outbox-test-commands")
        ev_pull, events = events_pair(paths.events)
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
        ev_pull.close()
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


def test_a_passes_token0s_leave_in_one_batch_before_their_streams_hear() -> None:
    """A pass's token 0s of requests that named a subscriber go in one batch (token0s); the
    pass tells the engine they are out (Token0SentCmd) and each request's own stream hears
    of it (Token0Routed) only after the batch was queued, its writer woken first. One that
    ends its request, or has no subscriber, goes to its stream as the event itself."""
    async def main() -> None:
        async with live_bridge() as (bridge, push, pump):
            sub, _ = bridge.hub.subscribe("router-a")
            queues = {rid: bridge.open(rid) for rid in ("p1", "p2", "p3", "p4")}
            for rid in ("p1", "p2", "p3"):
                bridge.hub.attach_token0(rid, sub)
            order: list[str] = []

            async def writer() -> None:
                batch = await sub.next_batch()
                order.append("batch")
                assert [(e.request_id, e.token_id) for e in batch.token0s] == [
                    ("p1", 11), ("p2", 12)]

            async def stream(rid: str) -> Any:
                got = await queues[rid].get()
                order.append(rid)
                return got

            sent = bridge.send

            def send(cmd: Any) -> None:  # the commands still go to the engine's socket
                order.append(f"{type(cmd).__name__}:{cmd.rid}")
                sent(cmd)

            bridge.send = send  # type: ignore[method-assign]
            w = asyncio.create_task(writer())
            readers = {rid: asyncio.create_task(stream(rid)) for rid in queues}
            await asyncio.sleep(0)  # every reader waits before the pass
            await push.send_multipart([encode(Token0Event(
                rid, tok, "t", None, "stop" if rid == "p3" else None, "", 10, 5))
                for rid, tok in (("p1", 11), ("p2", 12), ("p3", 13), ("p4", 14))])
            got = {rid: await asyncio.wait_for(t, 5) for rid, t in readers.items()}
            await asyncio.wait_for(w, 5)
            assert isinstance(got["p1"], Token0Routed) and got["p1"].event.token_id == 11
            assert isinstance(got["p2"], Token0Routed)
            assert isinstance(got["p3"], Token0Event) and got["p3"].finish == "stop"
            assert isinstance(got["p4"], Token0Event)  # no subscriber named
            # the batch's writer ran before the routed requests' streams
            assert order.index("batch") < order.index("p1")
            assert order.index("batch") < order.index("p2")
            # the pass itself told the engine that the routed token 0s are out, before
            # their streams' tasks ran; the others' streams send it themselves
            cmds = [o for o in order if o.startswith("Token0SentCmd")]
            assert cmds == ["Token0SentCmd:p1", "Token0SentCmd:p2"]
            assert order.index("Token0SentCmd:p2") < min(order.index("p1"), order.index("p2"))

    asyncio.run(main())
