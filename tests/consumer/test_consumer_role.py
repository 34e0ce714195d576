"""The consumer's role code in one process (role_harness: tiny engines, fake transfer, no
servers): reservations through the scheduler, aborts in each consumer state, the
reservation deadline, and a reservation that waits behind a full pool."""

from __future__ import annotations

import logging
import time

from role_harness import PD
from tiny_models import PROMPTS

from engine.llm import LLM
from engine.request_state import RequestState
from engine.sampling_params import SamplingParams
from worker.messages import AbortCmd, DecodeCmd, ReservedEvent
from worker.token_batch import TokensEvent

S = RequestState
GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)


def test_pd_in_one_process_equals_colocated(tiny_llama):
    prompt = PROMPTS[2]
    ref = LLM(tiny_llama, block_size=4).generate([prompt], GREEDY)[0]
    pd = PD(tiny_llama, producer_kw={"max_num_batched_tokens": 16})
    pd.submit("r", prompt, GREEDY)
    pd.run(lambda: pd.finished("r"))
    assert pd.tokens("r") == ref.token_ids
    t = pd.transfer("r")
    assert t is not None and t.ok, t
    assert pd.p.whole() and pd.c.whole()


def test_the_first_tokens_carry_the_handoff_s_stamps_in_their_order(tiny_llama):
    # the producer stamps the notice as it hands it to its sender, the receiver when it
    # read it and when the KV was whole, the consumer when it admitted the request
    pd = PD(tiny_llama)
    pd.submit("r", PROMPTS[1], GREEDY)
    pd.run(lambda: pd.finished("r"))
    first, *rest = [e for e in pd.c.of("r", TokensEvent) if e.ids]
    assert 0 < first.notice_sent_ns <= first.notice_seen_ns <= first.kv_done_ns \
        <= first.kv_ready_ns <= time.time_ns()
    assert rest and all(e.notice_sent_ns == e.notice_seen_ns == e.kv_done_ns
                        == e.kv_ready_ns == 0 for e in rest)  # the first message only


def test_reservation_waits_behind_a_full_pool_and_is_admitted_when_blocks_free(tiny_llama):
    # 14 blocks of 4: "a" (50 tokens) takes 13 for its prompt, so "b" (11 tokens, 3 blocks)
    # must wait in RESERVING until "a" finishes and frees them.
    pd = PD(tiny_llama, consumer_kw={"num_kv_blocks": 14})
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    pd.submit("a", PROMPTS[2], params)
    pd.run(lambda: pd.c.of("a", ReservedEvent) != [])
    pd.submit("b", PROMPTS[0], params)
    for _ in range(3):
        pd.turn()
    assert pd.state(pd.c, "b") == S.RESERVING
    assert pd.c.of("b", ReservedEvent) == []
    assert pd.consumer.load().waiting == 1
    pd.run(lambda: pd.finished("a"))
    pd.run(lambda: pd.finished("b"))
    assert pd.c.of("b", ReservedEvent), "b was never given blocks"
    ref = LLM(tiny_llama, block_size=4).generate([PROMPTS[0]], params)[0]
    assert pd.tokens("b") == ref.token_ids
    assert pd.p.whole() and pd.c.whole()


def test_reservations_take_seats_like_local_requests(tiny_llama):
    # max_num_seqs 1: the second reservation waits for the first request's seat, not
    # only for blocks (the pool has room for both).
    pd = PD(tiny_llama, consumer_kw={"max_num_seqs": 1})
    params = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
    pd.submit("a", PROMPTS[0], params)
    pd.submit("b", PROMPTS[1], params)
    pd.run(lambda: pd.c.of("a", ReservedEvent) != [])
    assert pd.state(pd.c, "b") == S.RESERVING
    pd.run(lambda: pd.finished("a") and pd.finished("b"))
    assert pd.p.whole() and pd.c.whole()


def _consumer_only(tiny_llama: str, **kw: object) -> PD:
    pd = PD(tiny_llama, **kw)  # type: ignore[arg-type]
    pd.auto_pair = False  # the producer never hears of the reservation
    return pd


def test_abort_while_reserving(tiny_llama):
    pd = _consumer_only(tiny_llama, consumer_kw={"num_kv_blocks": 14})
    wire = SamplingParams(max_tokens=4)  # 50 + 4 tokens fit 14 blocks
    pd.consumer.on_command(DecodeCmd("a", tuple(PROMPTS[2]), wire, False))
    pd.consumer.on_command(DecodeCmd("b", tuple(PROMPTS[0]), wire, False))
    pd.c.turn()
    assert pd.state(pd.c, "a") == S.WAITING_FOR_KV and pd.state(pd.c, "b") == S.RESERVING
    pd.consumer.on_command(AbortCmd("b"))
    (ev,) = pd.c.of("b", TokensEvent)
    assert ev.finish == "abort" and "waiting for KV blocks" in ev.error
    pd.consumer.on_command(AbortCmd("a"))
    pd.c.turn()
    assert pd.c.whole()


def test_abort_while_waiting_for_kv_frees_blocks_once_the_receiver_is_terminal(tiny_llama):
    pd = _consumer_only(tiny_llama)
    pd.consumer.on_command(DecodeCmd("a", tuple(PROMPTS[0]), GREEDY, False))
    pd.c.turn()
    assert pd.state(pd.c, "a") == S.WAITING_FOR_KV
    used = pd.c.engine.block_accounting().used
    assert used == 3
    pd.consumer.on_command(AbortCmd("a"))
    # the cancel is only reported by the receiver's next poll: blocks still held until then
    assert pd.c.engine.block_accounting().used == used
    pd.c.turn()
    (ev,) = pd.c.of("a", TokensEvent)
    assert ev.finish == "abort" and "cancelled" in ev.error
    assert pd.c.whole()


def test_abort_while_decoding(tiny_llama):
    pd = PD(tiny_llama)
    pd.submit("a", PROMPTS[0], SamplingParams(max_tokens=50, temperature=0, ignore_eos=True))
    pd.run(lambda: any(e.ids for e in pd.c.of("a", TokensEvent)))
    assert pd.state(pd.c, "a") == S.DECODING
    pd.consumer.on_command(AbortCmd("a"))
    assert pd.c.of("a", TokensEvent)[-1].finish == "abort"
    pd.run(lambda: not pd.c.engine.has_unfinished())
    assert pd.c.whole() and pd.p.whole()


def test_reservation_deadline_frees_blocks_and_says_which_request(tiny_llama, caplog):
    pd = _consumer_only(tiny_llama, reservation_s=0.2)
    pd.consumer.on_command(DecodeCmd("late", tuple(PROMPTS[0]), GREEDY, False))
    pd.c.turn()
    assert pd.state(pd.c, "late") == S.WAITING_FOR_KV
    assert pd.c.engine.block_accounting().used == 3
    time.sleep(0.3)
    with caplog.at_level(logging.WARNING, logger="pdserve.consumer"):
        pd.c.turn()
    (ev,) = pd.c.of("late", TokensEvent)
    assert ev.finish == "error" and "timed_out" in ev.error
    assert any("late" in r.message and "WAITING_FOR_KV" in r.message for r in caplog.records)
    assert pd.c.whole()
