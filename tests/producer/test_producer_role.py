"""The producer's role code in one process (role_harness: tiny engines, fake transfer, no
servers): abort in each producer state, lease expiry, token 0 as the last token, and no
block freed while a push may still read it (preemption and abort with chunks in flight)."""

from __future__ import annotations

import logging
import time
from typing import Any

from role_harness import PD
from tiny_models import PROMPTS

from engine.llm import LLM
from engine.request_state import RequestState
from engine.sampling_params import SamplingParams
from transfer import TransferStatus
from worker.messages import AbortCmd, Token0Event, TransferResultEvent
from worker.token_batch import TokensEvent

S = RequestState
GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
CHUNKED = {"max_num_batched_tokens": 16}  # a 50-token prompt takes 4 steps


class HeldSender:
    """The fake sender, except that a cancel completes only when the test says so: the
    real backends drain the operations already posted first, which takes a while."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.held: list[tuple[str, str]] = []

    def cancel(self, rid: str, reason: str = "cancelled") -> None:
        self.held.append((rid, reason))

    def let_go(self) -> None:
        for rid, reason in self.held:
            self.inner.cancel(rid, reason)
        self.held.clear()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def _result(pd: PD, rid: str) -> tuple[bool, str]:
    t = pd.transfer(rid)
    assert t is not None, f"no transfer result for {rid}"
    return t.ok, t.error


def test_abort_while_queued(tiny_llama):
    pd = PD(tiny_llama)
    pd.submit("q", PROMPTS[0], GREEDY, decode=False)
    assert pd.state(pd.p, "q") == S.QUEUED
    pd.producer.on_command(AbortCmd("q"))
    assert _result(pd, "q") == (False, "aborted by the router")
    assert pd.p.whole() and pd.p.of("q", Token0Event) == []


def test_abort_while_prefilling_before_any_push(tiny_llama):
    pd = PD(tiny_llama, producer_kw=CHUNKED)
    pd.submit("p", PROMPTS[2], GREEDY, decode=False)
    pd.p.turn()
    assert pd.state(pd.p, "p") == S.PREFILLING
    pd.producer.on_command(AbortCmd("p"))
    assert _result(pd, "p") == (False, "aborted by the router")
    pd.p.turn()
    assert pd.p.whole() and pd.p.of("p", Token0Event) == []


def test_abort_with_chunks_in_flight_holds_them_until_the_cancel_completes(tiny_llama):
    pd = PD(tiny_llama, producer_kw=CHUNKED)
    held = HeldSender(pd.producer.sender)
    pd.producer.sender = held  # type: ignore[assignment]
    pd.submit("p", PROMPTS[2], GREEDY)
    pd.run(lambda: pd.producer.out["p"].pushed > 0)
    pushed = pd.producer.out["p"].pushed
    assert pd.state(pd.p, "p") == S.PREFILLING
    pd.producer.on_command(AbortCmd("p"))
    assert pd.state(pd.p, "p") == S.FINISHED_ABORTED
    for _ in range(3):  # the sender may still read the pushed blocks: none may be reused
        pd.p.turn()
        assert pd.p.engine.block_accounting().used == pushed
        assert held.inner.status("p") == TransferStatus.IN_FLIGHT
    assert pd.transfer("p") is None
    held.let_go()
    pd.p.turn()
    ok, error = _result(pd, "p")
    assert not ok and "cancelled" in error and "aborted by the router" in error
    pd.c.turn()
    assert pd.p.whole() and pd.c.whole()


def test_abort_while_transferring(tiny_llama):
    pd = PD(tiny_llama)
    pd.auto_token0 = False  # token 0 never confirmed: the final notice cannot leave
    pd.submit("t", PROMPTS[0], GREEDY)
    pd.run(lambda: pd.state(pd.p, "t") == S.TRANSFERRING and pd.producer.out["t"].pushed)
    pd.producer.on_command(AbortCmd("t"))
    pd.turn()
    ok, error = _result(pd, "t")
    assert not ok and "aborted by the router" in error
    pd.run(lambda: bool(pd.c.of("t", TokensEvent)))
    assert pd.c.of("t", TokensEvent)[-1].finish == "abort"
    assert pd.p.whole() and pd.c.whole()


def test_lease_expiry_frees_blocks_and_says_which_request(tiny_llama, caplog):
    pd = PD(tiny_llama, lease_s=0.3)
    pd.submit("lease-me", PROMPTS[0], GREEDY, decode=False)  # no consumer: no destination ever
    pd.run(lambda: pd.state(pd.p, "lease-me") == S.TRANSFERRING)
    assert pd.p.engine.block_accounting().used == 3
    time.sleep(0.4)
    with caplog.at_level(logging.WARNING, logger="pdserve.producer"):
        pd.p.turn()
    ok, error = _result(pd, "lease-me")
    assert not ok and "lease expired" in error and "no destination" in error
    assert any("lease-me" in r.getMessage() and "TRANSFERRING" in r.getMessage()
               for r in caplog.records), [r.getMessage() for r in caplog.records]
    assert pd.producer.lease_expiries == 1 and pd.p.whole()


def test_max_tokens_one_ends_at_token0(tiny_llama):
    pd = PD(tiny_llama)
    pd.submit("one", PROMPTS[0], SamplingParams(max_tokens=1, temperature=0), decode=False)
    pd.run(lambda: bool(pd.p.of("one", Token0Event)))
    (t0,) = pd.p.of("one", Token0Event)
    assert t0.finish == "length"
    ref = LLM(tiny_llama, block_size=4).generate([PROMPTS[0]], GREEDY)[0]
    assert t0.token_id == ref.token_ids[0]
    pd.p.turn()
    assert pd.transfer("one") is None and pd.p.whole() and not pd.producer.out


def test_eos_at_token0_with_early_chunks_pushed(tiny_llama):
    # The early chunks went to the consumer; token 0 is a stop token, so their transfer is
    # cancelled, and the pinned blocks return only when the sender says it is terminal.
    t0 = LLM(tiny_llama, block_size=4).generate([PROMPTS[2]], GREEDY)[0].token_ids[0]
    params = SamplingParams(max_tokens=6, temperature=0, stop_token_ids=[t0])
    pd = PD(tiny_llama, producer_kw=CHUNKED)
    held = HeldSender(pd.producer.sender)
    pd.producer.sender = held  # type: ignore[assignment]
    pd.submit("eos", PROMPTS[2], params)
    pd.run(lambda: bool(pd.p.of("eos", Token0Event)))
    (ev,) = pd.p.of("eos", Token0Event)
    assert ev.finish == "stop" and ev.token_id == t0
    pushed = pd.producer.out["eos"].pushed
    assert pushed > 0 and pd.p.engine.block_accounting().used == pushed
    held.let_go()
    pd.turn()
    pd.turn()
    assert pd.transfer("eos") is None  # token 0 said how it ended; no second verdict
    assert pd.p.whole() and pd.c.whole()


def test_preempted_producer_keeps_pushed_blocks_until_the_transfer_ends(tiny_llama):
    # 16 blocks of 4. "b" (40 tokens, no consumer) prefills first and then holds 10 blocks
    # in TRANSFERRING; "a" (40 tokens) is chunked behind it, pushes its first chunks to the
    # consumer, and is preempted when it cannot grow. The pushed blocks stay pinned.
    a_prompt, b_prompt = list(range(10, 50)), list(range(60, 100))
    pd = PD(tiny_llama, producer_kw={"num_kv_blocks": 16, **CHUNKED})
    pd.submit("b", b_prompt, GREEDY, decode=False)
    pd.submit("a", a_prompt, GREEDY)
    pd.run(lambda: pd.p.engine.num_preemptions > 0, turns=20)
    out = pd.producer.out["a"]
    assert pd.state(pd.p, "a") == S.QUEUED and out.pushed > 0
    req = pd.p.engine.requests["a"]
    pinned = list(req.pinned)
    assert len(pinned) == out.pushed and req.block_ids == []
    # b's 10 blocks plus a's pushed ones: nothing a push may still read went back
    assert pd.p.engine.block_accounting().used == 10 + out.pushed
    assert pd.producer.sender.status("a") == TransferStatus.IN_FLIGHT
    pd.producer.on_command(AbortCmd("b"))  # frees b's blocks: "a" is admitted again
    pd.run(lambda: pd.finished("a"))
    ref = LLM(tiny_llama, block_size=4).generate([a_prompt], GREEDY)[0]
    assert pd.tokens("a") == ref.token_ids
    assert _result(pd, "a")[0]
    assert pd.p.whole() and pd.c.whole()


def test_the_loop_waits_for_token0_sent_only_while_the_final_notice_needs_it(tiny_llama):
    """command_wait_ms: > 0 from token 0 (blocks all pushed, destination known) until the
    Token0SentCmd, then 0; never past TOKEN0_SENT_WAIT_S."""
    from producer.handler import TOKEN0_SENT_WAIT_S
    from worker.messages import Token0SentCmd

    pd = PD(tiny_llama)
    pd.auto_token0 = False
    assert pd.producer.command_wait_ms() == 0
    pd.submit("w", PROMPTS[0], GREEDY)
    pd.run(lambda: bool(pd.p.of("w", Token0Event)))
    wait = pd.producer.command_wait_ms()
    assert 0 < wait <= TOKEN0_SENT_WAIT_S * 1e3
    pd.producer.on_command(Token0SentCmd("w"))
    assert pd.producer.command_wait_ms() == 0
    pd.run(lambda: pd.finished("w"))
    pd.submit("late", PROMPTS[1], GREEDY)
    pd.run(lambda: bool(pd.p.of("late", Token0Event)))
    time.sleep(TOKEN0_SENT_WAIT_S + 0.01)  # no confirmation came: the loop goes on
    assert pd.producer.command_wait_ms() == 0


def test_a_full_waiting_queue_refuses_as_busy_and_keeps_serving(tiny_llama):
    """Past --max-waiting the engine refuses a new prefill: the transfer result says busy
    (the router then goes to another producer or refuses with RESOURCE_EXHAUSTED), nothing
    is held for it, and the queued request still completes."""
    pd = PD(tiny_llama, producer_kw={"max_waiting": 1})
    pd.submit("first", PROMPTS[0], GREEDY)
    pd.submit("second", PROMPTS[1], GREEDY)  # before any step: the queue holds "first"
    (busy,) = pd.p.of("second", TransferResultEvent)
    assert not busy.ok and busy.busy, busy
    assert busy.error == "producer busy: waiting queue is full (1 requests)", busy.error
    assert pd.state(pd.p, "second") is None
    pd.consumer.on_command(AbortCmd("second"))  # the router's teardown of its reservation
    pd.run(lambda: pd.finished("first"))
    result = pd.transfer("first")
    assert result is not None and result.ok and not result.busy, result
    pd.run(lambda: pd.p.whole() and pd.c.whole())


def test_token0_leaves_before_the_kv_pushes_of_its_step(tiny_llama, monkeypatch):
    """The first-token hold: the step's token 0s are flushed to the gRPC process before the
    handler posts any of their KV pushes (and before the rest of the loop turn)."""
    pd = PD(tiny_llama)
    flushed: list[str] = []  # request ids whose token 0 had left, in order
    pushed_after: list[tuple[str, list[str]]] = []

    def flush() -> None:
        flushed.extend(e.rid for e in pd.p.events if isinstance(e, Token0Event)
                       and e.rid not in flushed)

    pd.producer.flush_events = flush
    push = type(pd.producer)._push_ready

    def recording_push(self: Any, o: Any) -> None:
        if o.token0_at:
            pushed_after.append((o.rid, list(flushed)))
        push(self, o)

    monkeypatch.setattr(type(pd.producer), "_push_ready", recording_push)
    for rid, prompt in (("a", PROMPTS[0]), ("b", PROMPTS[1])):
        pd.submit(rid, prompt, GREEDY)
    pd.run(lambda: pd.finished("a") and pd.finished("b"))
    assert sorted(flushed) == ["a", "b"]
    assert pushed_after, "no push after token 0"
    for rid, seen in pushed_after:
        assert rid in seen, (rid, seen)  # its token 0 was out before its push
