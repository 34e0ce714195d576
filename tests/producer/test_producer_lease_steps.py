"""A producer's lease is judged as of the moment its loop last listened to the router.

The engine loop (``WorkerLoop.turn``) applies commands only between steps. A step longer
than the lease (a long prefill chunk, a CPU under load) must not fail a request whose
renewal (``HoldCmd``), destination or token-0 confirmation arrived during that step and
still waits in the command queue: that was "lease expired in TRANSFERRING ... no
destination" under load, with the consumer merely full. Real ``WorkerLoop``, real ZMQ
command socket, real tiny engines and the in-process fake transfer; each producer step is
stretched past the lease while the "router" keeps sending, standing in for a loaded CPU.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import pytest
from role_harness import FAKE, LoopProducer, Side, engine, until
from tiny_models import PROMPTS

from consumer.handler import ConsumerHandler
from engine.llm import LLM
from engine.request_state import RequestState
from engine.sampling_params import SamplingParams
from worker.messages import (
    Command,
    DecodeCmd,
    DestinationCmd,
    HoldCmd,
    PrefillCmd,
    ReservedEvent,
    Token0Event,
    Token0SentCmd,
    TransferResultEvent,
)
from worker.token_batch import TokensEvent

S = RequestState
GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
LEASE_S = 0.3
SLOW_S = 3 * LEASE_S  # every producer step while stretched: three leases
BUSY = list(range(10, 34))  # 24 tokens: three 8-token prefill chunks, so three steps


class StretchedProducer(LoopProducer):
    """Whose steps the test stretches while the "router" keeps sending."""

    def __init__(self, path: str) -> None:
        super().__init__(path, LEASE_S, max_num_batched_tokens=8)
        self._real_step = self.engine.step
        self._confirmed: set[str] = set()

    def stretch_steps(self, router: Callable[[], list[Command]]) -> None:
        """From now on each step takes SLOW_S; every LEASE_S / 4 meanwhile the router sends
        ``router()`` (they queue: the loop reads them only after the step)."""
        def slow_step() -> Any:
            out = self._real_step()
            end = time.monotonic() + SLOW_S
            while (left := end - time.monotonic()) > 0:
                time.sleep(min(left, LEASE_S / 4))
                for cmd in router():
                    self.send(cmd)
            return out
        self.engine.step = slow_step  # type: ignore[method-assign]

    def turn(self) -> None:
        self.loop.turn()
        for e in self.events:  # the gRPC process confirms each token 0 it streamed
            if isinstance(e, Token0Event) and e.finish is None and e.rid not in self._confirmed:
                self._confirmed.add(e.rid)
                self.send(Token0SentCmd(e.rid))

@pytest.fixture
def producer(tiny_llama: str):  # type: ignore[no-untyped-def]
    p = StretchedProducer(tiny_llama)
    yield p
    p.close()


def _transferring(p: StretchedProducer, rid: str) -> None:
    p.send(PrefillCmd(rid, tuple(PROMPTS[0]), GREEDY, 0))
    until(lambda: p.engine.state_of(rid) == S.TRANSFERRING, p.turn)


def test_holds_that_arrive_during_a_step_longer_than_the_lease_keep_the_blocks(producer,
                                                                               tiny_llama):
    p = producer
    _transferring(p, "held")  # its consumer is full: no reservation yet
    # "busy" keeps the engine stepping; once its token 0 is out it waits for a consumer too
    p.stretch_steps(lambda: [HoldCmd("held", "c0"), HoldCmd("busy", "c0")])
    p.send(PrefillCmd("busy", tuple(BUSY), GREEDY, 0))
    steps = 0
    while not p.of("busy", Token0Event):
        t0 = time.monotonic()
        p.turn()
        steps += time.monotonic() - t0 > LEASE_S
    assert steps >= 3  # every one of them outlasted the lease
    assert p.handler.lease_expiries == 0 and not p.of("held", TransferResultEvent)
    assert p.engine.state_of("held") == S.TRANSFERRING
    assert (t := p.handler.load().transfer) is not None and t.orphan_blocks == 0
    # the router goes quiet (its consumer was dropped): the lease still frees the blocks
    p.stretch_steps(lambda: [])
    quiet = time.monotonic()
    until(lambda: bool(p.of("held", TransferResultEvent)), p.turn)
    (res,) = p.of("held", TransferResultEvent)
    assert not res.ok and "lease expired" in res.error and "no destination" in res.error
    assert LEASE_S <= time.monotonic() - quiet < LEASE_S + SLOW_S + 2.0
    until(lambda: bool(p.of("busy", TransferResultEvent)), p.turn)
    assert p.handler.lease_expiries == 2
    until(lambda: p.engine.block_accounting().free == p.engine.block_accounting().total,
           p.turn)


def test_a_destination_that_arrives_during_a_long_step_is_used(producer, tiny_llama):
    p = producer
    c_eng = engine(tiny_llama, "consumer")
    c = Side(lambda emit: ConsumerHandler(c_eng, emit, FAKE))
    _transferring(p, "held")
    c.handler.on_command(DecodeCmd("held", tuple(PROMPTS[0]), GREEDY, False))
    until(lambda: bool(c.of("held", ReservedEvent)), c.turn)
    (r,) = c.of("held", ReservedEvent)
    # the router holds until it forwards the reservation, during the first long step, and
    # then sends nothing more (paired)
    sends: list[list[Command]] = [[HoldCmd("held", "c0")],
                                  [DestinationCmd("held", "c0", r.kv_address, r.block_ids)]]
    p.stretch_steps(lambda: sends.pop(0) if sends else [])
    p.send(HoldCmd("held", "c0"))
    # one token: token 0 ends "busy", so it never waits for a consumer of its own
    p.send(PrefillCmd("busy", tuple(BUSY), SamplingParams(max_tokens=1), 0))
    until(lambda: any(e.finish for e in c.of("held", TokensEvent))
           or any(not e.ok for e in p.of("held", TransferResultEvent)), p.turn, c.turn)
    assert p.handler.lease_expiries == 0
    (res,) = p.of("held", TransferResultEvent)
    assert res.ok, res
    ref = LLM(tiny_llama, block_size=4).generate([PROMPTS[0]], GREEDY)[0]
    tokens = [p.of("held", Token0Event)[0].token_id]
    tokens += [t for e in c.of("held", TokensEvent) for t in e.ids]
    assert tokens == ref.token_ids


def test_a_long_prefill_is_no_orphan(producer):
    """No lease runs before token 0: a prompt whose prefill outlasts the lease holds no
    orphaned blocks (they would make a busy producer report its pool exhausted)."""
    p = producer
    p.stretch_steps(lambda: [])
    p.send(PrefillCmd("busy", tuple(BUSY), GREEDY, 0))
    until(lambda: p.engine.state_of("busy") == S.PREFILLING, p.turn)
    start = time.monotonic()
    while time.monotonic() - start < 2 * LEASE_S:
        p.turn()
        assert p.engine.state_of("busy") == S.PREFILLING
    load = p.handler.load()
    assert load.kv_blocks_free < load.kv_blocks_total  # it does hold blocks
    assert load.transfer is not None and load.transfer.orphan_blocks == 0
