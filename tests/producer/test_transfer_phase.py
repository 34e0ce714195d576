"""The producer's transfer table is executable: every listed edge is accepted and every other
refused, the derived flags agree with it, and the real handler walks it (role_harness: tiny
engines, fake transfer) in the orders a request's events allow."""

from __future__ import annotations

import itertools
from collections.abc import Iterator

import pytest
from role_harness import PD
from tiny_models import PROMPTS

import producer.handler
from engine.sampling_params import SamplingParams
from producer.transfer_phase import TRANSFER_EDGES, BadTransfer, TransferPhase, check_transfer
from worker.messages import AbortCmd, DecodeCmd, Token0Event, Token0SentCmd

T = TransferPhase
GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
CHUNKED = {"max_num_batched_tokens": 16}  # a 50-token prompt takes 4 steps


def test_every_listed_edge_is_accepted_and_every_other_refused() -> None:
    refused = 0
    for old, new in itertools.product(T, T):
        if (old, new) in TRANSFER_EDGES:
            check_transfer(old, new)
        else:
            refused += 1
            with pytest.raises(BadTransfer, match=f"{old.name} -> {new.name}"):
                check_transfer(old, new)
    assert refused > len(TRANSFER_EDGES)  # the table is a choice, not every pair


def test_nothing_leaves_ended_and_everything_else_may_end() -> None:
    assert not [e for e in TRANSFER_EDGES if e[0] is T.ENDED]
    assert all((p, T.ENDED) in TRANSFER_EDGES for p in T if p is not T.ENDED)
    # only a transfer whose blocks may have moved is cancelled through the sender
    assert {a for a, b in TRANSFER_EDGES if b is T.CANCELLING} == {p for p in T if p.has_dest}
    # no way back: a destination is never forgotten, a built notice never unbuilt
    for a, b in TRANSFER_EDGES:
        assert not (a.has_dest and b.awaits_dest) and not (a.token0_out and b.awaits_dest
                                                            and not a.awaits_dest)
        assert not (a.token0_out and b in (T.AWAITING_DEST, T.PUSHING))


def test_the_event_helpers_follow_the_table() -> None:
    for p in T:
        if p.awaits_dest:
            assert (p, p.with_dest()) in TRANSFER_EDGES and p.with_dest().has_dest
        else:
            with pytest.raises(BadTransfer, match=f"the destination in {p.name}"):
                p.with_dest()
        if p in (T.AWAITING_DEST, T.PUSHING):
            assert (p, p.with_token0()) in TRANSFER_EDGES and p.with_token0().token0_out
        else:
            with pytest.raises(BadTransfer, match=f"token 0 in {p.name}"):
                p.with_token0()
        sent = p.with_token0_sent()
        assert sent is None or (p, sent) in TRANSFER_EDGES
    assert [p for p in T if p.with_token0_sent() is not None] == [T.TOKEN0_AWAITING_DEST,
                                                                  T.TOKEN0_HELD]


def test_the_flags_are_a_partition_of_the_live_phases() -> None:
    for p in T:
        live = p not in (T.CANCELLING, T.ENDED)
        assert p.awaits_dest + p.has_dest == live, p  # exactly one while live
    assert [p for p in T if p.token0_out and p.awaits_dest] == [T.TOKEN0_AWAITING_DEST,
                                                               T.RELEASED_AWAITING_DEST]


@pytest.fixture
def moves(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[tuple[T, T]]]:
    """Every phase change the real handler makes, in order (one request per test)."""
    seen: list[tuple[T, T]] = []

    def recording(old: T, new: T) -> None:
        check_transfer(old, new)
        seen.append((old, new))

    monkeypatch.setattr(producer.handler, "check_transfer", recording)
    yield seen


def _walk(moves: list[tuple[T, T]]) -> list[T]:
    assert moves and all(a[1] == b[0] for a, b in itertools.pairwise(moves)), moves
    return [moves[0][0], *(b for _, b in moves)]


def test_destination_first_then_token0(tiny_llama: str, moves: list[tuple[T, T]]) -> None:
    pd = PD(tiny_llama, producer_kw=CHUNKED)
    pd.submit("a", PROMPTS[2], GREEDY)
    pd.run(lambda: pd.finished("a") and "a" not in pd.producer.out)
    assert _walk(moves) == [T.AWAITING_DEST, T.PUSHING, T.TOKEN0_HELD, T.RELEASED,
                            T.NOTIFIED, T.ENDED]
    result = pd.transfer("a")
    assert result is not None and result.ok


def test_token0_before_the_destination(tiny_llama: str, moves: list[tuple[T, T]]) -> None:
    pd = PD(tiny_llama)
    pd.auto_token0 = False
    pd.submit("b", PROMPTS[0], GREEDY, decode=False)  # the consumer's reservation waits
    pd.run(lambda: bool(pd.p.of("b", Token0Event)))
    assert pd.producer.out["b"].phase is T.TOKEN0_AWAITING_DEST
    pd.producer.on_command(Token0SentCmd("b"))
    assert pd.producer.out["b"].phase is T.RELEASED_AWAITING_DEST
    pd.consumer.on_command(DecodeCmd("b", tuple(PROMPTS[0]), GREEDY, False))
    pd.run(lambda: pd.finished("b") and "b" not in pd.producer.out)
    assert _walk(moves) == [T.AWAITING_DEST, T.TOKEN0_AWAITING_DEST,
                            T.RELEASED_AWAITING_DEST, T.RELEASED, T.NOTIFIED, T.ENDED]


def test_abort_with_chunks_pushed_cancels_through_the_sender(
        tiny_llama: str, moves: list[tuple[T, T]]) -> None:
    pd = PD(tiny_llama, producer_kw=CHUNKED)
    pd.submit("c", PROMPTS[2], GREEDY)
    pd.run(lambda: "c" in pd.producer.out and pd.producer.out["c"].started)
    pd.producer.on_command(AbortCmd("c"))
    assert pd.producer.out["c"].phase is T.CANCELLING
    pd.run(lambda: "c" not in pd.producer.out)
    assert _walk(moves) == [T.AWAITING_DEST, T.PUSHING, T.CANCELLING, T.ENDED]
    result = pd.transfer("c")
    assert result is not None and not result.ok


def test_token0_that_ends_the_request_before_any_push(
        tiny_llama: str, moves: list[tuple[T, T]]) -> None:
    pd = PD(tiny_llama)
    pd.auto_pair = False  # no destination ever comes
    pd.submit("d", PROMPTS[1], SamplingParams(max_tokens=1, temperature=0))
    pd.run(lambda: bool(pd.p.of("d", Token0Event)))
    assert "d" not in pd.producer.out
    assert _walk(moves) == [T.AWAITING_DEST, T.ENDED]
