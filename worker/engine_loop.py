"""The engine process: applies commands, steps the engine, lets the role poll transfers,
and reports events, without ever waiting on the gRPC process."""

from __future__ import annotations

import logging
import math
import os
import signal
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

import zmq

from engine.config import EngineConfig
from worker import ipc
from worker.event_link import EventWriter
from worker.heap import freeze_startup_heap, gc_pauses
from worker.kv_forward import KVEventForwarder
from worker.launch_pacer import LaunchPacer
from worker.load_report import HeldRow, LoadReport
from worker.messages import (
    Command,
    Event,
    FatalEvent,
    MessageError,
    ReadyEvent,
    StatsEvent,
    StopCmd,
    decode,
    encode,
)
from worker.outbox import EventOutbox, EventSink
from worker.parent_death import die_with_parent
from worker.role import Emit, RoleHandler
from worker.step_stats import StepStats

if TYPE_CHECKING:  # the gRPC process imports this module for EngineSpec: no torch there
    from engine.llm_engine import LLMEngine

log = logging.getLogger("pdserve.worker")
# Load reports feed the gRPC process's heartbeats (one a second by default), so one sent
# every half second keeps what a heartbeat carries at most that old; each one costs the
# engine a report of every held request and the gRPC process its decode, idle or not.
STATS_INTERVAL_S = 0.5
# How long the loop sleeps between looks at the command socket and the device while a
# step that is read at once runs (WorkerLoop.during_step): what it may add to the step's
# end. A sleep leaves the GIL to the transfer threads, as the blocking read would.
DURING_STEP_POLL_S = 50e-6
# The engine process's GIL switch interval. Its transfer I/O threads (transfer/io_loop.py)
# read the KV plane's frames and complete its copies; each wake-up of one needs the GIL,
# which the engine thread holds through its pure-Python stretches (scheduling a batch,
# reading a step's outputs). CPython makes a waiting thread ask for it only after the
# switch interval, 5 ms by default: a FINISH or a landed copy then waited up to 5 ms per
# wake-up (bench/probes/gil_wait_probe.py: 5.1 ms p50 behind a Python loop at 5 ms, 0.35 ms
# at 0.2 ms; an I/O thread with copies in flight got 688 rather than 159 of its ~970 turns a
# second, for ~2% of the loop's rate). Torch calls drop the GIL and are not affected.
GIL_SWITCH_INTERVAL_S = 0.2e-3
# Rows of held requests per load report (GET /debug/requests); the oldest first, since
# those are the ones an operator looks for.
MAX_LISTED_REQUESTS = 500
# Builds the role's handler around the built engine. The role package supplies it (the
# worker never imports producer/ or consumer/); it must be a module-level function so the
# spec pickles into the spawned engine process by reference.
HandlerFactory = Callable[["LLMEngine", Emit, "EngineSpec"], RoleHandler]


@dataclass(frozen=True)
class EngineSpec:
    """Everything the engine process needs, picklable for a spawned process."""

    role: str  # "producer" | "consumer" | "colocated": names, logs and registers the worker
    engine: EngineConfig
    handler_factory: HandlerFactory
    transfer: dict[str, Any] = field(default_factory=dict)  # TransferConfig fields
    threads: int = 0  # torch threads (0: leave torch's default)
    lease_s: float = 30.0  # producer: hold blocks this long for a destination / an ack
    # consumer: how long reserved blocks wait for the producer's first bytes; long, since
    # the request may queue behind others' prefill on the producer (a dead producer is
    # caught sooner by peer liveness and by the router aborting the leg)
    reservation_s: float = 600.0
    # consumer: launch decode steps late while KV transfers are in flight (launch_pacer.py)
    launch_pacing: bool = True


class WorkerLoop:
    def __init__(self, handler: RoleHandler, commands: zmq.Socket, events: EventSink,
                 outbox: EventOutbox | None = None, pacer: LaunchPacer | None = None) -> None:
        """outbox: where the handler emits (its events leave at the loop's flush points);
        None: the handler sends its own, and the loop's leave through a new outbox.
        pacer: when to launch steps while KV transfers are in flight; None: at once."""
        self.handler = handler
        self.engine = handler.engine
        self.commands = commands
        self.events = events
        self.poller = zmq.Poller()
        self.poller.register(commands, zmq.POLLIN)
        self.running = True
        self._last_stats = 0.0
        self.steps = StepStats()
        self.pacer = pacer if pacer is not None else LaunchPacer(enabled=False)
        self.outbox = outbox if outbox is not None else EventOutbox(events)
        handler.flush_events = self.outbox.flush
        self.kv_events = KVEventForwarder(self.engine, self.outbox.emit)
        self.gc = gc_pauses()
        # commands read during a step that wait for its end, in the order they came
        self._held: list[Command] = []
        # for the log's window line: looks at a running step, and commands taken then
        self.device_looks = self.taken_during_steps = 0
        self._logged = (0, 0)
        if not self.engine.defers_output:
            self.engine.device_wait = self.during_step
            self.engine.between_launches = self.take_commands

    def during_step(self, left_s: float) -> None:
        """While the device runs a step the engine reads at once (a producer's), applies
        the commands the role takes then: a destination that came after token 0's step
        otherwise waited for the whole next prefill step before its final notice could
        leave. Everything else is held, in order, for the next drain. left_s: when the
        device knows how long it still runs (a simulated one), the loop sleeps in the
        poll until a command comes or about then, not in short naps."""
        self.device_looks += 1
        if left_s > 2 * DURING_STEP_POLL_S:
            self.poller.poll(max(0, math.floor(left_s * 1e3)))
        self.take_commands()
        time.sleep(DURING_STEP_POLL_S)

    def take_commands(self) -> None:
        """The commands queued now, as ``during_step`` takes them, without waiting: also
        called between the decoder layers of a step's eager launch."""
        if not int(self.commands.get(zmq.EVENTS)) & zmq.POLLIN:  # type: ignore[arg-type]
            return  # the common case, per layer: one flag read
        applied = False
        for msg in self._queued():
            if self._held or isinstance(msg, StopCmd) or not self.handler.takes_during_step(msg):
                self._held.append(msg)
            else:
                self.handler.on_command(msg)
                self.taken_during_steps += 1
                applied = True
        if applied:
            self.outbox.flush()  # e.g. a failed destination's answer

    def _queued(self) -> Iterator[Command]:
        """The commands queued on the socket now, in order, without waiting; bad ones are
        logged and dropped (one bad message must not stop every request)."""
        while True:
            try:
                data = self.commands.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                msg = decode(data)
            except MessageError as e:
                log.error("dropped a bad command: %s", e)
                continue
            if isinstance(msg, Event):
                log.error("dropped a bad command: %s is an event", type(msg).KIND)
                continue
            yield msg

    def _apply(self, msg: Command) -> None:
        if isinstance(msg, StopCmd):
            self.running = False
        else:
            self.handler.on_command(msg)

    def _drain_commands(self, timeout_ms: int) -> bool:
        """Applies every queued command, waiting up to timeout_ms for the first; False when
        none came."""
        self.outbox.flush()  # what earlier commands emitted does not wait for the next
        if self._held:  # read during the last step: they came first
            held, self._held = self._held, []
            for cmd in held:
                self._apply(cmd)
                if not self.running:
                    return True
        elif not self.poller.poll(timeout_ms):
            return False
        for msg in self._queued():
            self._apply(msg)
            if not self.running:
                break  # the rest stays queued: the loop stops
        return True

    def turn(self) -> None:
        busy = self.engine.has_unfinished()
        idle_wait = 0 if busy else (1 if self.handler.has_background_work() else 50)
        self._drain_commands(idle_wait)
        while self.running and (wait := self.handler.command_wait_ms()) > 0:
            if not self._drain_commands(wait):
                break
        if self.engine.has_unfinished():
            self._pace()
            self.outbox.flush()  # the commands' answers do not wait for the forward
            self.handler.before_step(time.time_ns())
            self.steps.start()
            step = self.engine.step()
            self.steps.end(step.outputs)
            if self.pacer.enabled:
                self.pacer.observe(self.engine.timing)
            # always: a step with no tokens may still report reservations or final blocks
            self.handler.on_outputs(step, time.time_ns())
        else:
            self.steps.idle()
        self.handler.after_step()
        self.kv_events.forward()  # blocks the step (or a landed transfer) cached or evicted
        now = time.monotonic()
        if now - self._last_stats >= STATS_INTERVAL_S:
            self._last_stats = now
            self.outbox.emit(StatsEvent(load_report(self.handler, self.steps)))
            if (line := self.steps.window_line(gc_pause_s=self.gc.max_s)) is not None:
                self.gc.take_max()
                if self.engine.device_wait is not None:
                    looks, taken = self._logged
                    self._logged = (self.device_looks, self.taken_during_steps)
                    line += (f", {self.device_looks - looks} looks at running steps, "
                             f"{self.taken_during_steps - taken} commands taken during them")
                log.info("%s", line)
        # the step's tokens and ends, what after_step polled, the cache events and the
        # load report: one message
        self.outbox.flush()

    def _pace(self) -> None:
        """Waits (taking commands) until the pacer's launch time, then polls the transfers
        again, so that a request whose KV landed meanwhile joins this step."""
        if not self.pacer.enabled:
            return
        wait = self.pacer.wait_s(time.time_ns(), self.engine.has_inflight,
                                 self.handler.awaiting_kv())
        if wait <= 0:
            return
        end = time.monotonic() + wait
        while self.running and (left := end - time.monotonic()) > 0:
            self._drain_commands(max(1, round(left * 1000)))
        self.pacer.waited(wait)
        self.handler.after_step()

    def run(self) -> None:
        while self.running:
            self.turn()


def load_report(handler: RoleHandler, steps: StepStats | None = None) -> LoadReport:
    """The role's load plus every request the engine holds (state, ages, blocks) and the
    engine's step counters."""
    held = sorted(handler.engine.held_requests(), key=lambda h: -h.age_s)
    return replace(handler.load(),
                   requests=tuple(HeldRow.of(h) for h in held[:MAX_LISTED_REQUESTS]),
                   requests_held=len(held), steps=(steps or StepStats()).counters())


def make_handler(spec: EngineSpec, emit: Emit) -> RoleHandler:
    from engine.llm import build_engine

    engine = build_engine(spec.engine)
    # Before ready: llguidance's view of the tokenizer holds the GIL while it is built
    # (0.3 s for SmolLM2's 49k ids, seconds for 128k), which would stall the serving loop
    # on the first structured request.
    engine.grammars.prepare()
    return spec.handler_factory(engine, emit, spec)


def engine_process_main(spec: EngineSpec, paths: ipc.IpcPaths) -> None:
    """Entry point of the spawned engine process."""
    # A SIGTERM sent to the whole process group (scancel, `kill -- -PGID`, a launcher's
    # stop) is the worker's to handle: it drains, then stops this process with StopCmd.
    # Dying here at once would end the requests the drain is meant to finish.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    die_with_parent()
    sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)
    logging.basicConfig(level=logging.INFO, format=f"[{spec.role}-engine] %(message)s")
    if spec.threads:
        import torch

        torch.set_num_threads(spec.threads)
    ctx = zmq.Context()
    commands = ipc.bind_pull(ctx, paths.commands)
    events = EventWriter(paths.events)
    handler = None
    outbox = EventOutbox(events)
    try:
        handler = make_handler(spec, outbox.emit)
        # Load first: registration (triggered by ready) then reports real block counts.
        outbox.emit(StatsEvent(load_report(handler)))
        outbox.emit(ReadyEvent(handler.ready_info()))
        outbox.flush()
        # paced only while the role awaits KV (a consumer: RoleHandler.awaiting_kv)
        loop = WorkerLoop(handler, commands, events, outbox, LaunchPacer(spec.launch_pacing))
        # the model, its graphs and every import stay for the process's life: no collection
        # needs to walk them again (worker/heap.py)
        log.debug("froze %d start-up objects out of garbage collection", freeze_startup_heap())
        loop.run()
    except Exception as e:  # the gRPC process reports it and exits; nothing else can act
        log.error("engine process failed: %s", traceback.format_exc())
        # what the handler emitted before it failed, then the failure
        # a stream socket: what was sent is read after this end closes too
        events.send_multipart([*outbox.parts, encode(FatalEvent(f"{type(e).__name__}: {e}"))])
    finally:
        if handler is not None:
            handler.close()
        events.close()
        ctx.destroy(linger=200)
    # All this process holds is released above (the handler stops any tensor-parallel
    # ranks). The interpreter's own teardown after it (freeing the model, torch's modules)
    # took ~0.45 s of every worker stop and role change, with the worker waiting on it.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
