"""A request run's event queue that coalesces token messages waiting together.

When the client loop falls behind its legs (a busy router, a slow client), the tokens that
queued up for a request leave as one client message instead of one per engine step: the
per-token cost of framing (gRPC message, SSE chunk, JSON) is paid once per read, so a
router under load does less work per token rather than more. Only plain token messages
merge (never a finishing one into a later one, never across other kinds of events), so the
client sees the same tokens, text and logprobs in the same order.

The wait for the next event is bounded (``get(timeout)``) without a timer per wait: the
queue keeps one timer, armed at the earliest deadline a waiter had, and a timer that fires
before the current deadline (a later wait moved it on) re-arms itself instead of ending the
wait. Waiting for the next token then costs a float store, not a timer scheduled and
cancelled per token; the timer fires about once per bound, when it is not a timeout.
"""

from __future__ import annotations

import asyncio
import collections
import math

from pdserve.v1 import common_pb2, worker_pb2

from router.requests.run_events import Event, TokensRead


class EventQueue:
    def __init__(self) -> None:
        self._items: collections.deque[Event] = collections.deque()
        self._loop: asyncio.AbstractEventLoop | None = None  # the loop of the first wait
        self._waiter: asyncio.Future[bool] | None = None  # result: True = an event came
        self._deadline = 0.0  # loop time the current wait ends at
        self._bound: float | None = None  # the current wait's timeout (``touch``)
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at = 0.0
        self.merged = 0  # token messages folded into an earlier one (metrics, tests)

    def put_nowait(self, ev: Event) -> None:
        self._items.append(ev)
        w = self._waiter
        if w is not None and not w.done():
            w.set_result(True)

    def get_nowait(self) -> Event:
        if not self._items:
            raise asyncio.QueueEmpty
        return self._take()

    def qsize(self) -> int:
        return len(self._items)

    def empty(self) -> bool:
        return not self._items

    async def get(self, timeout: float | None = None) -> Event | None:
        """The next event; None once ``timeout`` seconds passed without one."""
        if self._items:
            return self._take()
        loop = self._loop
        if loop is None:
            loop = self._loop = asyncio.get_running_loop()
        self._bound = timeout
        if timeout is None:
            self._deadline = math.inf
        else:
            self._deadline = loop.time() + timeout
            if self._timer is None or self._timer_at > self._deadline:
                self._arm(self._deadline)
        while not self._items:
            w = self._waiter = loop.create_future()
            try:
                if not await w:
                    return None
            finally:
                self._waiter = None
        return self._take()

    def parked(self) -> bool:
        """The reader waits in ``get`` with nothing in hand: an event handed past the queue
        now cannot overtake one the reader took and has not handed on yet."""
        w = self._waiter
        return w is not None and not w.done()

    def touch(self) -> None:
        """Something came for the parked reader past the queue: its bounded wait starts
        over, as if it had read an event and waited again."""
        if self._bound is not None and self._loop is not None:
            self._deadline = self._loop.time() + self._bound

    def _arm(self, at: float) -> None:
        assert self._loop is not None
        if self._timer is not None:
            self._timer.cancel()
        self._timer_at = at
        self._timer = self._loop.call_at(at, self._expire)

    def _expire(self) -> None:
        assert self._loop is not None
        self._timer = None
        w = self._waiter
        if w is None or w.done() or self._deadline == math.inf:
            return  # nobody waits on a bound: the next bounded wait arms it again
        if self._loop.time() >= self._deadline:
            w.set_result(False)
        else:  # the wait it was armed for ended; the current one ends later
            self._arm(self._deadline)

    def close(self) -> None:
        """Cancels the timer (the run is over)."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _take(self) -> Event:
        ev = self._items.popleft()
        if not isinstance(ev, TokensRead):
            return ev
        items = self._items
        merged: worker_pb2.Tokens | None = None
        while (items and isinstance(nxt := items[0], TokensRead)
               and is_open(merged or ev.tokens) and _plain_end(nxt.tokens)):
            if merged is None:
                merged = worker_pb2.Tokens()
                merged.CopyFrom(ev.tokens)
            items.popleft()
            _append(merged, nxt.tokens)
            self.merged += 1
        return ev if merged is None else TokensRead(merged)


def is_open(t: worker_pb2.Tokens) -> bool:
    """More tokens may follow this message (it neither ends nor fails the request)."""
    return not t.finish_reason and not t.error


def _plain_end(t: worker_pb2.Tokens) -> bool:
    """Tokens that go on, or end the request normally. An error or abort stays a message of
    its own: the run decides on it alone (e.g. a failure with no tokens may migrate)."""
    return not t.error and t.finish_reason in (common_pb2.FINISH_REASON_UNSPECIFIED,
                                               common_pb2.FINISH_REASON_STOP,
                                               common_pb2.FINISH_REASON_LENGTH)


def _append(into: worker_pb2.Tokens, t: worker_pb2.Tokens) -> None:
    into.token_ids.extend(t.token_ids)
    into.text += t.text
    into.logprobs.extend(t.logprobs)
    into.finish_reason = t.finish_reason
    into.stop_reason = t.stop_reason
    into.error = t.error
    # timing stamps belong to the first message that carried them
    into.first_step_ns = into.first_step_ns or t.first_step_ns
    if t.kv_ready_ns and not into.kv_ready_ns:  # the handoff's other stamps come with it
        into.kv_ready_ns = t.kv_ready_ns
        into.notice_sent_ns = t.notice_sent_ns
        into.notice_seen_ns = t.notice_seen_ns
        into.kv_done_ns = t.kv_done_ns
