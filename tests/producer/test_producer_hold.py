"""The producer's lease while the consumer's reservation waits for blocks (backpressure):
the router's HoldCmd renews it, so a long wait fails nothing; once the renewals stop (a dead
consumer, a lost router) the lease frees the blocks within ``lease_s``."""

from __future__ import annotations

import time

from role_harness import PD
from tiny_models import PROMPTS

from engine.llm import LLM
from engine.request_state import RequestState
from engine.sampling_params import SamplingParams
from worker.messages import DecodeCmd, HoldCmd, TransferResultEvent

S = RequestState
GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
LEASE_S = 0.3


def _hold_for(pd: PD, rid: str, seconds: float) -> float:
    """Sends holds every quarter lease for ``seconds``; returns when the last one went."""
    end = time.monotonic() + seconds
    last = 0.0
    while time.monotonic() < end:
        last = time.monotonic()
        pd.producer.on_command(HoldCmd(rid, "c0"))
        pd.turn()
        time.sleep(LEASE_S / 4)
    return last


def test_holds_keep_the_blocks_past_the_lease_then_the_request_completes(tiny_llama):
    pd = PD(tiny_llama, lease_s=LEASE_S)
    pd.submit("queued", PROMPTS[0], GREEDY, decode=False)  # the reservation waits
    pd.run(lambda: pd.state(pd.p, "queued") == S.TRANSFERRING)
    _hold_for(pd, "queued", 6 * LEASE_S)
    assert pd.producer.lease_expiries == 0 and not pd.p.of("queued", TransferResultEvent)
    assert pd.state(pd.p, "queued") == S.TRANSFERRING  # still holding its blocks
    # blocks free up on the consumer: the reservation is made and goes to the producer
    pd.consumer.on_command(DecodeCmd("queued", tuple(PROMPTS[0]), GREEDY, False))
    pd.run(lambda: pd.finished("queued"))
    result = pd.transfer("queued")
    assert result is not None and result.ok, result
    ref = LLM(tiny_llama, block_size=4).generate([PROMPTS[0]], GREEDY)[0]
    assert pd.tokens("queued") == ref.token_ids
    pd.run(lambda: pd.p.whole() and pd.c.whole())


def test_when_holds_stop_the_lease_frees_the_blocks(tiny_llama):
    pd = PD(tiny_llama, lease_s=LEASE_S)
    pd.submit("orphan", PROMPTS[0], GREEDY, decode=False)
    pd.run(lambda: pd.state(pd.p, "orphan") == S.TRANSFERRING)
    # then the consumer dies: the router sends no more holds
    stopped = _hold_for(pd, "orphan", 3 * LEASE_S)
    assert pd.producer.lease_expiries == 0
    while not pd.p.of("orphan", TransferResultEvent):
        assert time.monotonic() - stopped < LEASE_S + 2.0, "the lease never expired"
        pd.turn()
        time.sleep(0.02)
    (res,) = pd.p.of("orphan", TransferResultEvent)
    assert not res.ok and "lease expired" in res.error and "no destination" in res.error
    assert time.monotonic() - stopped >= LEASE_S  # not before the last hold's lease ran out
    assert pd.producer.lease_expiries == 1 and pd.p.whole()


def test_a_hold_after_the_destination_changes_nothing(tiny_llama):
    pd = PD(tiny_llama, lease_s=LEASE_S)
    pd.submit("paired", PROMPTS[1], GREEDY)
    pd.run(lambda: pd.transfer("paired") is not None)
    pd.producer.on_command(HoldCmd("paired", "c0"))  # late, and for a request it finished
    pd.producer.on_command(HoldCmd("never-seen", "c0"))
    pd.run(lambda: pd.finished("paired"))
    result = pd.transfer("paired")
    assert result is not None and result.ok
    pd.run(lambda: pd.p.whole() and pd.c.whole())
