"""Drives the producer's and the consumer's role code in one process: real tiny engines, the
in-process fake transfer, no servers. Stands in for what the worker's gRPC process and the
router do around the roles (forwarding a reservation to the producer, confirming token 0
went out), each step visible to the test."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

import pytest
import zmq
from event_link_pair import events_pair
from tiny_models import make_tiny_model

from consumer.handler import ConsumerHandler
from engine.llm import LLM
from engine.llm_engine import LLMEngine
from engine.request_state import RequestState
from engine.sampling_params import SamplingParams
from producer.handler import ProducerHandler
from worker import ipc
from worker.engine_loop import WorkerLoop
from worker.messages import (
    Command,
    DecodeCmd,
    DestinationCmd,
    Event,
    PrefillCmd,
    ReservedEvent,
    Token0Event,
    Token0SentCmd,
    TransferResultEvent,
    encode,
)
from worker.role import RoleHandler
from worker.token_batch import TokensBatchEvent, TokensEvent

FAKE = {"backend": "fake"}


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> str:
    return make_tiny_model(os.path.join(tmp_path_factory.mktemp("roles"), "llama"), "llama")


def engine(path: str, role: str, **kw: Any) -> LLMEngine:
    kw.setdefault("block_size", 4)
    return LLM(path, role=role, **kw).engine


class Side:
    """One worker's engine process without its sockets: the same turn as WorkerLoop."""

    def __init__(self, make: Callable[[Callable[[Event], None]], RoleHandler]) -> None:
        self.events: list[Event] = []
        self.batches = 0  # TokensBatchEvents seen (one per step that had tokens)
        self.handler = make(self._emit)
        self.engine = self.handler.engine

    def turn(self) -> None:
        if self.engine.has_unfinished():
            self.handler.before_step(0)
            self.handler.on_outputs(self.engine.step(), 0)
        self.handler.after_step()

    def _emit(self, ev: Event) -> None:
        # a step's tokens come as one batch; tests look at them per request
        if isinstance(ev, TokensBatchEvent):
            self.batches += 1
            self.events.extend(ev.events())
        else:
            self.events.append(ev)

    def of(self, rid: str, kind: type) -> list[Any]:
        return [e for e in self.events if isinstance(e, kind) and e.rid == rid]

    def whole(self) -> bool:
        """Every block back (cached ones unowned, so evictable: free) and no request held."""
        acc = self.engine.block_accounting()
        refs = all(self.engine.blocks.refcount(b) == 0 for b in range(acc.total))
        return acc.free == acc.total and refs and not self.engine.held_requests()


class PD:
    """A producer and a consumer wired the way the router pairs them."""

    def __init__(self, path: str, producer_kw: dict[str, Any] | None = None,
                 consumer_kw: dict[str, Any] | None = None, lease_s: float = 30.0,
                 reservation_s: float = 600.0, transfer: dict[str, Any] | None = None) -> None:
        p_eng = engine(path, "producer", **(producer_kw or {}))
        c_eng = engine(path, "consumer", **(consumer_kw or {}))
        xfer = transfer or FAKE  # e.g. {"backend": "ucx", "host": "127.0.0.1"}: real UCX
        self.p = Side(lambda emit: ProducerHandler(p_eng, emit, xfer, lease_s))
        self.c = Side(lambda emit: ConsumerHandler(c_eng, emit, xfer, reservation_s))
        self.producer: ProducerHandler = self.p.handler  # type: ignore[assignment]
        self.consumer: ConsumerHandler = self.c.handler  # type: ignore[assignment]
        self.auto_pair = True  # forward reservations to the producer
        self.auto_token0 = True  # confirm token 0 went out, as the gRPC process does
        self._paired: set[str] = set()
        self._t0: set[str] = set()

    def submit(self, rid: str, prompt: list[int], params: SamplingParams,
               decode: bool = True, reuse_cached: bool = False, cache_salt: str = "") -> None:
        wire = params
        if decode:
            self.consumer.on_command(DecodeCmd(rid, tuple(prompt), wire, False, (), 0,
                                               cache_salt, reuse_cached))
        self.producer.on_command(PrefillCmd(rid, tuple(prompt), wire, 0, (), cache_salt))

    def turn(self) -> None:
        self.p.turn()
        self.c.turn()
        for e in self.c.events:
            if self.auto_pair and isinstance(e, ReservedEvent) and e.rid not in self._paired:
                self._paired.add(e.rid)
                self.producer.on_command(DestinationCmd(e.rid, "c0", e.kv_address,
                                                        e.block_ids, e.cached_blocks))
        for e in self.p.events:
            if (self.auto_token0 and isinstance(e, Token0Event) and e.finish is None
                    and e.rid not in self._t0):
                self._t0.add(e.rid)
                self.producer.on_command(Token0SentCmd(e.rid))

    def run(self, until: Callable[[], bool], turns: int = 400,
            timeout_s: float | None = None) -> None:
        """Turns both sides until ``until()``: at most ``turns`` turns, or with a real
        transfer backend (whose bytes move on their own threads) for ``timeout_s`` seconds."""
        end = time.monotonic() + timeout_s if timeout_s is not None else None
        n = 0
        while end is not None and time.monotonic() < end or end is None and n < turns:
            if until():
                return
            self.turn()
            n += 1
            if end is not None:
                time.sleep(0.001)
        raise AssertionError("condition not reached")

    def finished(self, rid: str) -> bool:
        return any(e.finish for e in self.c.of(rid, TokensEvent))

    def tokens(self, rid: str) -> list[int]:
        """Token 0 from the producer, the rest from the consumer: what the client sees."""
        t0 = self.p.of(rid, Token0Event)
        return [t0[0].token_id] + [t for e in self.c.of(rid, TokensEvent) for t in e.ids]

    def transfer(self, rid: str) -> TransferResultEvent | None:
        found = self.p.of(rid, TransferResultEvent)
        return found[0] if found else None

    def state(self, side: Side, rid: str) -> RequestState | None:
        return side.engine.state_of(rid)

    def close(self) -> None:
        """Closes both sides' transfer endpoints (a real backend's threads and ports)."""
        self.producer.close()
        self.consumer.close()


class LoopProducer:
    """A producer's engine process without the process: the real ``WorkerLoop`` and its ZMQ
    command socket, a real engine, the fake transfer. ``send`` is what its gRPC process does
    with the router's messages."""

    def __init__(self, path: str, lease_s: float, **engine_kw: Any) -> None:
        self.paths = ipc.IpcPaths.fresh()
        self.ctx = zmq.Context()
        pull = ipc.bind_pull(self.ctx, self.paths.commands)
        self.push = ipc.connect_push(self.ctx, self.paths.commands)
        # takes the loop's load reports
        self.reports_end, reports = events_pair(self.paths.events)
        self.events: list[Event] = []
        self.engine = engine(path, "producer", **engine_kw)
        self.handler = ProducerHandler(self.engine, self.events.append, FAKE, lease_s)
        self.loop = WorkerLoop(self.handler, pull, reports)

    def send(self, cmd: Command | bytes) -> None:
        """Sends, and returns once the loop's socket has a message to read: a turn right
        after it reads it, however slowly this machine delivers (a loaded CI host missed
        the loop's 1 ms poll)."""
        self.push.send(cmd if isinstance(cmd, bytes) else encode(cmd))
        assert self.loop.commands.poll(10_000, zmq.POLLIN), "the command never arrived"

    def of(self, rid: str, kind: type) -> list[Any]:
        return [e for e in self.events if isinstance(e, kind) and e.rid == rid]

    def close(self) -> None:
        self.handler.close()
        self.ctx.destroy(linger=0)
        self.reports_end.close()
        self.paths.cleanup()


def until(cond: Callable[[], bool], *turns: Callable[[], None], limit_s: float = 60) -> None:
    """Runs the turns in order until ``cond()``; fails past limit_s."""
    end = time.monotonic() + limit_s
    while not cond():
        assert time.monotonic() < end, "condition not reached"
        for turn in turns:
            turn()
