"""A producer takes the router's destinations while its engine's step runs on the device.

A producer reads each step at once (it never defers), so its engine loop used to block in
that read and apply commands only between steps. A destination, a hold or a token-0
confirmation that came just after token 0's step then waited for the whole next prefill
step before the request's final notice could leave (the first gap's "KV ready" part).
``LLMEngine.device_wait`` now runs the loop's ``during_step`` while the step is unread.

Real ``WorkerLoop``, real ZMQ command socket, real tiny engines and the in-process fake
transfer. The only stand-in is the device: each stretched step's ids stay "not ready" for
``BUSY_S`` after the launch (what a GPU step looks like to the host), and the "router"
sends its commands at the first look, i.e. during the step.
"""

from __future__ import annotations

import logging
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
from producer.transfer_phase import TransferPhase
from worker.messages import (
    Command,
    DecodeCmd,
    DestinationCmd,
    PrefillCmd,
    ReservedEvent,
    StopCmd,
    Token0Event,
    Token0SentCmd,
    TransferResultEvent,
)
from worker.token_batch import TokensEvent

GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
BUSY_S = 0.5  # how long each stretched step's ids stay unread on the "device"
OTHER = list(range(10, 34))  # 24 tokens: another request, whose step the commands come in


class Producer(LoopProducer):
    """Whose next step the test can keep "running" on a busy device."""

    def __init__(self, path: str) -> None:
        super().__init__(path, 30.0, max_num_batched_tokens=32)
        self.looks = 0  # device_wait calls during stretched steps

    def busy_device(self, during: list[Command | bytes],
                    at_end: Callable[[], None]) -> None:
        """The next step's ids are unread for BUSY_S; ``during`` is sent at its first look
        and ``at_end`` runs when the ids become readable (before the engine reads them)."""
        runner = self.engine.runner
        real = runner.execute

        def execute(*a: Any, **kw: Any) -> Any:
            runner.execute = real  # type: ignore[method-assign]  # this step only
            samplers, out = real(*a, **kw)
            ready_at = time.monotonic() + BUSY_S

            def ready() -> bool:
                self.looks += 1
                if self.looks == 1:
                    for cmd in during:
                        self.send(cmd)
                if time.monotonic() < ready_at:
                    return False
                at_end()
                return True
            out.ready = ready
            return samplers, out

        runner.execute = execute  # type: ignore[method-assign]


@pytest.fixture
def producer(tiny_llama: str):  # type: ignore[no-untyped-def]
    p = Producer(tiny_llama)
    yield p
    p.close()


def _awaiting_destination(p: Producer, tiny_llama: str) -> tuple[Side, ReservedEvent]:
    """Request "late": its prompt prefilled, its token 0 out and confirmed, waiting for a
    destination; and a consumer's reservation for it that the router has yet to send."""
    rid = "late"
    p.send(PrefillCmd(rid, tuple(PROMPTS[0]), GREEDY, 0))
    until(lambda: p.engine.state_of(rid) == RequestState.TRANSFERRING, p.loop.turn)
    p.send(Token0SentCmd(rid))
    p.loop.turn()
    assert p.handler.out[rid].phase is TransferPhase.RELEASED_AWAITING_DEST
    c_eng = engine(tiny_llama, "consumer")
    c = Side(lambda emit: ConsumerHandler(c_eng, emit, FAKE))
    c.handler.on_command(DecodeCmd(rid, tuple(PROMPTS[0]), GREEDY, False))
    until(lambda: bool(c.of(rid, ReservedEvent)), c.turn)
    (r,) = c.of(rid, ReservedEvent)
    return c, r


def test_a_destination_sent_during_a_step_releases_the_notice_before_the_step_ends(
        producer, tiny_llama):
    p = producer
    c, r = _awaiting_destination(p, tiny_llama)
    seen: dict[str, Any] = {}

    def at_end() -> None:
        seen.setdefault("phase", p.handler.out["late"].phase)
        seen.setdefault("other", p.engine.state_of("other"))

    # the router forwards the consumer's reservation while another prompt's step runs
    p.busy_device([DestinationCmd("late", "c0", r.kv_address, r.block_ids)], at_end)
    p.send(PrefillCmd("other", tuple(OTHER), SamplingParams(max_tokens=1), 0))
    start = time.monotonic()
    p.loop.turn()
    assert time.monotonic() - start >= BUSY_S  # the step did wait for the "device"
    assert p.looks > 1 and p.loop.device_looks == p.looks - 1  # the last look: ready
    assert p.loop.taken_during_steps == 1
    # the notice left while the step was still running, not after it
    assert seen == {"phase": TransferPhase.NOTIFIED, "other": RequestState.PREFILLING}
    # and the request decodes on the consumer exactly as colocated
    until(lambda: any(e.finish for e in c.of("late", TokensEvent)), p.loop.turn, c.turn)
    ref = LLM(tiny_llama, block_size=4).generate([PROMPTS[0]], GREEDY)[0]
    tokens = [p.of("late", Token0Event)[0].token_id]
    tokens += [t for e in c.of("late", TokensEvent) for t in e.ids]
    assert tokens == ref.token_ids


def test_commands_behind_one_that_waits_keep_their_order(producer, tiny_llama, caplog):
    """A prefill must not join the running step, and a destination sent after it waits
    with it (it could name that very request); a bad message is dropped on the way."""
    p = producer
    _c, r = _awaiting_destination(p, tiny_llama)
    seen: dict[str, Any] = {}

    def at_end() -> None:
        seen.setdefault("phase", p.handler.out["late"].phase)
        seen.setdefault("queued", "queued" in p.engine.requests)

    p.busy_device([b"\x00not a command", PrefillCmd("queued", (5, 6, 7), GREEDY, 0),
                   DestinationCmd("late", "c0", r.kv_address, r.block_ids)], at_end)
    p.send(PrefillCmd("other", tuple(OTHER), SamplingParams(max_tokens=1), 0))
    with caplog.at_level(logging.ERROR, "pdserve.worker"):
        p.loop.turn()
    assert seen == {"phase": TransferPhase.RELEASED_AWAITING_DEST, "queued": False}
    assert p.loop.taken_during_steps == 0
    assert "dropped a bad command" in caplog.text
    p.loop.turn()  # the next drain applies both, in order
    assert "queued" in p.engine.requests
    until(lambda: bool(p.of("late", TransferResultEvent)), p.loop.turn)
    assert [e.ok for e in p.of("late", TransferResultEvent)] == [True]


def test_a_stop_during_a_step_ends_the_loop_after_it(producer):
    p = producer
    seen: dict[str, Any] = {}
    p.busy_device([StopCmd()], lambda: seen.setdefault("running", p.loop.running))
    p.send(PrefillCmd("one", tuple(OTHER), SamplingParams(max_tokens=1), 0))
    p.loop.turn()
    assert seen == {"running": True}  # not stopped mid-step
    assert p.of("one", Token0Event)  # the step's token 0 went out
    p.loop.turn()
    assert not p.loop.running


def test_a_destination_sent_while_the_step_launches_is_taken_between_layers(producer,
                                                                            tiny_llama):
    """An eager forward's host launches are most of a producer's step on a GPU (and all of
    it on CPU): the loop also takes commands between decoder layers, not only once the
    launch has returned."""
    p = producer
    _c, r = _awaiting_destination(p, tiny_llama)
    layer0 = p.engine.runner.model.layers[0]
    real_forward = layer0.forward
    sent: list[bool] = []

    def forward(*a: Any, **kw: Any) -> Any:
        out = real_forward(*a, **kw)
        if not sent:  # the router sends while this step launches (a long layer)
            sent.append(True)
            p.send(DestinationCmd("late", "c0", r.kv_address, r.block_ids))
            time.sleep(0.2)
        return out

    layer0.forward = forward
    seen: dict[str, Any] = {}
    real_outputs = p.handler.on_outputs

    def on_outputs(*a: Any, **kw: Any) -> None:
        seen.setdefault("phase", p.handler.out["late"].phase)  # as the step ends
        real_outputs(*a, **kw)

    p.handler.on_outputs = on_outputs  # type: ignore[method-assign]
    p.send(PrefillCmd("other", tuple(OTHER), SamplingParams(max_tokens=1), 0))
    p.loop.turn()
    assert sent and seen == {"phase": TransferPhase.NOTIFIED}
    assert p.loop.taken_during_steps == 1 and p.loop.device_looks == 0  # CPU: no wait
    assert p.engine.runner.model.between_layers is None  # set for the step alone
