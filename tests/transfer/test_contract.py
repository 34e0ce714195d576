"""The contract, run against every backend: bytes, notice, ack, cancel, deadlines, books."""

from __future__ import annotations

import random
import threading
import time

import pytest
import torch
from xfer_helpers import LAYOUT, NET_BACKENDS, Pair

from transfer import Accounting, TransferError, TransferNotice, TransferStatus

S = TransferStatus


def _notice(rid: str, n: int = 100) -> TransferNotice:
    return TransferNotice(rid, 42, False, n, seed=5, logprobs=((42, -0.25), (7, -1.5)))


def _tables(kind: str, n: int, rng: random.Random) -> tuple[list[int], list[int]]:
    if kind == "contiguous":
        return list(range(3, 3 + n)), list(range(20, 20 + n))
    return rng.sample(range(LAYOUT.num_blocks), n), rng.sample(range(LAYOUT.num_blocks), n)


@pytest.mark.parametrize("kind", ["contiguous", "scattered"])
def test_bytes_land_exactly_chunk_by_chunk(pair: Pair, kind: str) -> None:
    rng = random.Random(kind)
    src, dst = _tables(kind, 24, rng)
    pair.rx.expect("r", dst)
    for i in range(0, 24, 5):  # 5 chunks of uneven size, as chunked prefill does
        pair.tx.push("r", pair.addr, src[i:i + 5], dst[i:i + 5])
    pair.tx.finish("r", _notice("r"))
    got = pair.rx.wait("r", 10)
    assert got.status == S.DONE, got
    assert got.notice == _notice("r")
    assert pair.tx.wait("r", 10).status == S.DONE
    for s, d in zip(src, dst, strict=True):
        assert torch.equal(pair.dst[d], pair.src[s]), (s, d)
    untouched = sorted(set(range(LAYOUT.num_blocks)) - set(dst))
    assert bool((pair.dst[untouched] == -1).all())
    pair.rx.release("r")
    pair.tx.release("r")
    assert pair.rx.accounting() == Accounting(0, 0, 1)
    assert pair.tx.accounting() == Accounting(0, 0, 1)


def test_many_requests_interleaved(pair: Pair) -> None:
    rng = random.Random(3)
    free = rng.sample(range(LAYOUT.num_blocks), 60)
    tables = {f"q{i}": (rng.sample(range(64), 12), free[i * 12:(i + 1) * 12]) for i in range(5)}
    for rid, (_, d) in tables.items():
        pair.rx.expect(rid, d)
    for c in range(0, 12, 4):
        for rid, (s, d) in tables.items():
            pair.tx.push(rid, pair.addr, s[c:c + 4], d[c:c + 4])
    for rid in tables:
        pair.tx.finish(rid, _notice(rid))
    for rid, (s, d) in tables.items():
        assert pair.rx.wait(rid, 10).status == S.DONE
        assert pair.tx.wait(rid, 10).status == S.DONE
        assert all(torch.equal(pair.dst[b], pair.src[a]) for a, b in zip(s, d, strict=True))
        pair.rx.release(rid)
        pair.tx.release(rid)
    assert pair.rx.accounting().transfers == 0 == pair.tx.accounting().transfers


@pytest.mark.parametrize("side", ["consumer", "producer"])
def test_cancel_mid_transfer(pair: Pair, side: str) -> None:
    src, dst = list(range(0, 16)), list(range(30, 46))
    pair.rx.expect("c", dst)
    pair.tx.push("c", pair.addr, src[:8], dst[:8])
    _until(lambda: pair.rx.status("c") == S.IN_FLIGHT)
    with pytest.raises(ValueError, match="not terminal"):
        pair.rx.release("c")
    who = pair.rx if side == "consumer" else pair.tx
    who.cancel("c", "client went away")
    a, b = pair.rx.wait("c", 10), pair.tx.wait("c", 10)
    assert a.status == S.CANCELLED and b.status == S.CANCELLED, (a, b)
    assert "client went away" in (a.error or "") + (b.error or "")
    with pytest.raises(TransferError, match="already CANCELLED"):
        pair.tx.push("c", pair.addr, src[8:], dst[8:])
    pair.rx.release("c")
    pair.tx.release("c")
    assert pair.rx.accounting().transfers == 0 and pair.rx.accounting().ops_in_flight == 0
    assert pair.tx.accounting().transfers == 0 and pair.tx.accounting().ops_in_flight == 0


def test_consumer_deadline_times_out(pair: Pair) -> None:
    pair.rx.expect("t", [1, 2, 3], deadline=time.monotonic() + 0.3)
    pair.tx.push("t", pair.addr, [5], [1])
    t0 = time.monotonic()
    assert pair.rx.wait("t", 10).status == S.TIMED_OUT
    assert time.monotonic() - t0 < 3
    got = pair.tx.wait("t", 10)
    assert got.status == S.CANCELLED and "deadline" in (got.error or "")


def test_push_to_unknown_request_fails_with_reason(pair: Pair) -> None:
    pair.tx.push("nope", pair.addr, [1, 2], [3, 4])
    got = pair.tx.wait("nope", 10)
    assert got.status == S.FAILED and "unknown request" in (got.error or "")
    assert bool((pair.dst == -1).all())  # nothing landed (pulling planes read nothing)


def test_push_outside_reservation_fails_both_sides(pair: Pair) -> None:
    pair.rx.expect("o", [10, 11])
    pair.tx.push("o", pair.addr, [1, 2], [10, 12])
    for side in (pair.tx, pair.rx):
        got = side.wait("o", 10)
        assert got.status == S.FAILED and "outside the reservation" in (got.error or ""), got


@pytest.mark.parametrize("backend", NET_BACKENDS)
def test_an_expect_made_before_the_push_holds_when_the_loop_is_mid_turn(backend: str) -> None:
    # CI once saw "unknown request" here: the consumer's I/O thread had drained its queued
    # calls for the turn, then read a push that was sent after expect() had returned. Freeze
    # it at exactly that point (inside on_readable, before its first receive) and check that
    # the expect() still counts for the push behind it.
    pair = Pair(backend)
    try:
        entered, go = threading.Event(), threading.Event()
        inner = pair.rx.on_readable  # type: ignore[attr-defined]

        def frozen(sock: object) -> None:
            if not go.is_set():
                entered.set()
                go.wait(10)
            inner(sock)

        pair.rx.on_readable = frozen  # type: ignore[attr-defined]
        pair.tx.push("first", pair.addr, [1], [1])  # wakes the consumer's socket
        assert entered.wait(10)
        pair.rx.expect("o", [10, 11])  # queued: the loop thread is held past its drain
        pair.tx.push("o", pair.addr, [1, 2], [10, 11])
        pair.tx.finish("o", _notice("o"))
        time.sleep(0.3)  # both messages reach the consumer's socket
        go.set()
        assert "unknown request" in (pair.tx.wait("first", 10).error or "")
        got = pair.rx.wait("o", 10)
        assert got.status == S.DONE and got.notice == _notice("o"), got
        assert pair.tx.wait("o", 10).status == S.DONE
        assert torch.equal(pair.dst[10], pair.src[1]) and torch.equal(pair.dst[11], pair.src[2])
    finally:
        go.set()
        pair.close()


def test_push_without_connect_fails(pair: Pair) -> None:
    pair.tx.push("x", "tcp://127.0.0.1:1", [1], [1])
    got = pair.tx.wait("x", 10)
    assert got.status == S.FAILED and "connect() first" in (got.error or "")


def test_bad_block_ids_raise_in_caller(pair: Pair) -> None:
    with pytest.raises(ValueError, match="outside"):
        pair.rx.expect("b", [LAYOUT.num_blocks])
    with pytest.raises(ValueError, match="differ in length"):
        pair.tx.push("b", pair.addr, [1, 2], [1])


def _until(cond: object, timeout: float = 10.0) -> None:
    end = time.monotonic() + timeout
    while not cond():  # type: ignore[operator]
        assert time.monotonic() < end, "condition not reached"
        time.sleep(0.005)


def test_a_push_arriving_after_the_consumer_let_go_lands_nowhere(pair: Pair) -> None:
    # The consumer cancels and frees its reservation while the producer, not told yet,
    # pushes into it: the blocks (maybe another request's by now) must stay untouched.
    dst = [40, 41, 42, 43]
    pair.rx.expect("late", dst)
    pair.rx.cancel("late", "client went away")
    assert pair.rx.wait("late", 10).status == S.CANCELLED
    pair.rx.release("late")
    pair.tx.push("late", pair.addr, [1, 2, 3, 4], dst)
    got = pair.tx.wait("late", 10)
    assert got.status == S.FAILED and "unknown request" in (got.error or ""), got
    # the consumer answers at once; a tag plane (ucx) may still be draining the run into
    # its 1-byte sink: that ends on its own, and nothing of it reaches the blocks
    _until(lambda: pair.rx.accounting().ops_in_flight == 0)
    assert bool((pair.dst[dst] == -1).all())
