"""A run's queue folds token messages that wait together into one, and nothing else."""

from __future__ import annotations

import asyncio

from pdserve.v1 import common_pb2, worker_pb2

from router.requests.event_queue import EventQueue
from router.requests.run_events import DecodeEnded, Event, TokensRead

STOP, ERROR = common_pb2.FINISH_REASON_STOP, common_pb2.FINISH_REASON_ERROR


def toks(ids: list[int], finish: int = 0, error: str = "", **kw: int) -> TokensRead:
    return TokensRead(worker_pb2.Tokens(
        token_ids=ids, text="".join(chr(97 + i) for i in ids), finish_reason=finish,  # type: ignore[arg-type]
        error=error, logprobs=[common_pb2.TokenLogprob(token_id=i) for i in ids], **kw))


def test_waiting_token_messages_leave_as_one() -> None:
    async def main() -> None:
        q = EventQueue()
        q.put_nowait(toks([0], kv_ready_ns=5))
        q.put_nowait(toks([1, 2], first_step_ns=7))
        q.put_nowait(toks([3], STOP))
        q.put_nowait(toks([9]))  # after a finish: never folded into it
        ev = await q.get()
        assert isinstance(ev, TokensRead)
        t = ev.tokens
        assert list(t.token_ids) == [0, 1, 2, 3] and t.text == "abcd"
        assert [lp.token_id for lp in t.logprobs] == [0, 1, 2, 3]
        assert t.finish_reason == STOP and (t.kv_ready_ns, t.first_step_ns) == (5, 7)
        assert q.merged == 2
        last = await q.get()
        assert isinstance(last, TokensRead) and list(last.tokens.token_ids) == [9]
        assert q.empty()

    asyncio.run(main())


def test_folded_messages_keep_the_stamps_of_the_first_that_carried_them() -> None:
    async def main() -> None:
        q = EventQueue()
        q.put_nowait(toks([0]))
        q.put_nowait(toks([1], kv_ready_ns=5, notice_sent_ns=2, notice_seen_ns=3,
                          kv_done_ns=4))
        q.put_nowait(toks([2], kv_ready_ns=50, notice_sent_ns=20, notice_seen_ns=30,
                          kv_done_ns=40))
        ev = await q.get()
        assert isinstance(ev, TokensRead) and list(ev.tokens.token_ids) == [0, 1, 2]
        t = ev.tokens
        assert (t.notice_sent_ns, t.notice_seen_ns, t.kv_done_ns, t.kv_ready_ns) == (2, 3, 4, 5)

    asyncio.run(main())


def test_errors_and_other_events_stay_apart() -> None:
    async def main() -> None:
        q = EventQueue()
        q.put_nowait(toks([0]))
        q.put_nowait(toks([], ERROR, "kv transfer failed"))  # may migrate: kept alone
        q.put_nowait(DecodeEnded())
        q.put_nowait(toks([1]))
        got: list[Event] = [q.get_nowait() for _ in range(4)]
        kinds = [(type(ev).__name__, list(ev.tokens.token_ids)
                  if isinstance(ev, TokensRead) else None) for ev in got]
        assert kinds == [("TokensRead", [0]), ("TokensRead", []), ("DecodeEnded", None),
                         ("TokensRead", [1])]
        assert q.merged == 0

    asyncio.run(main())


def test_a_bounded_wait_ends_at_its_own_deadline() -> None:
    """One timer serves every wait: a wait that ends early (an event came) leaves it armed,
    and it must neither end a later wait before that wait's bound nor an unbounded wait."""
    async def main() -> None:
        loop = asyncio.get_running_loop()
        q = EventQueue()
        t0 = loop.time()
        assert await q.get(0.05) is None  # nothing came: the bound ends it
        assert 0.045 <= loop.time() - t0 < 0.5

        loop.call_later(0.02, q.put_nowait, DecodeEnded())
        assert isinstance(await q.get(0.3), DecodeEnded)  # timer left armed at +0.3 s
        t1 = loop.time()
        assert await q.get(0.6) is None  # that timer fires first: it re-arms, no timeout
        assert loop.time() - t1 >= 0.55

        loop.call_later(0.02, q.put_nowait, DecodeEnded())
        assert isinstance(await q.get(0.05), DecodeEnded)
        loop.call_later(0.2, q.put_nowait, toks([5]))
        got = await q.get()  # unbounded: the +0.05 s timer must not end it
        assert isinstance(got, TokensRead) and list(got.tokens.token_ids) == [5]
        q.close()

    asyncio.run(main())
