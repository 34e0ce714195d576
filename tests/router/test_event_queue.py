"""A run's queue folds token messages that wait together into one, and nothing else."""

from __future__ import annotations

import asyncio

from pdserve.v1 import common_pb2, worker_pb2

from router.requests.event_queue import EventQueue
from router.requests.legs import Ev, Event

STOP, ERROR = common_pb2.FINISH_REASON_STOP, common_pb2.FINISH_REASON_ERROR


def toks(ids: list[int], finish: int = 0, error: str = "", **kw: int) -> Event:
    return Event(Ev.TOKENS, worker_pb2.Tokens(
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
        t = ev.payload
        assert list(t.token_ids) == [0, 1, 2, 3] and t.text == "abcd"
        assert [lp.token_id for lp in t.logprobs] == [0, 1, 2, 3]
        assert t.finish_reason == STOP and (t.kv_ready_ns, t.first_step_ns) == (5, 7)
        assert q.merged == 2
        assert list((await q.get()).payload.token_ids) == [9]
        assert q.empty()

    asyncio.run(main())


def test_errors_and_other_events_stay_apart() -> None:
    async def main() -> None:
        q = EventQueue()
        q.put_nowait(toks([0]))
        q.put_nowait(toks([], ERROR, "kv transfer failed"))  # may migrate: kept alone
        q.put_nowait(Event(Ev.DECODE_EOF))
        q.put_nowait(toks([1]))
        kinds = [(ev.kind, list(ev.payload.token_ids) if ev.payload else None)
                 for ev in [q.get_nowait() for _ in range(4)]]
        assert kinds == [(Ev.TOKENS, [0]), (Ev.TOKENS, []), (Ev.DECODE_EOF, None),
                         (Ev.TOKENS, [1])]
        assert q.merged == 0

    asyncio.run(main())
