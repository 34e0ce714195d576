"""A request run's event queue that coalesces token messages waiting together.

When the client loop falls behind its legs (a busy router, a slow client), the tokens that
queued up for a request leave as one client message instead of one per engine step: the
per-token cost of framing (gRPC message, SSE chunk, JSON) is paid once per read, so a
router under load does less work per token rather than more. Only plain token messages
merge (never a finishing one into a later one, never across other kinds of events), so the
client sees the same tokens, text and logprobs in the same order.
"""

from __future__ import annotations

import asyncio
import collections

from pdserve.v1 import common_pb2, worker_pb2

from router.requests.run_events import Event, TokensRead


class EventQueue:
    def __init__(self) -> None:
        self._items: collections.deque[Event] = collections.deque()
        self._ready = asyncio.Event()
        self.merged = 0  # token messages folded into an earlier one (metrics, tests)

    def put_nowait(self, ev: Event) -> None:
        self._items.append(ev)
        self._ready.set()

    def get_nowait(self) -> Event:
        if not self._items:
            raise asyncio.QueueEmpty
        return self._take()

    def qsize(self) -> int:
        return len(self._items)

    def empty(self) -> bool:
        return not self._items

    async def get(self) -> Event:
        while not self._items:
            self._ready.clear()
            await self._ready.wait()
        return self._take()

    def _take(self) -> Event:
        ev = self._items.popleft()
        if not isinstance(ev, TokensRead):
            return ev
        items = self._items
        merged: worker_pb2.Tokens | None = None
        while (items and isinstance(nxt := items[0], TokensRead)
               and _open(merged or ev.tokens) and _plain_end(nxt.tokens)):
            if merged is None:
                merged = worker_pb2.Tokens()
                merged.CopyFrom(ev.tokens)
            items.popleft()
            _append(merged, nxt.tokens)
            self.merged += 1
        return ev if merged is None else TokensRead(merged)


def _open(t: worker_pb2.Tokens) -> bool:
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
    into.kv_ready_ns = into.kv_ready_ns or t.kv_ready_ns
    into.first_step_ns = into.first_step_ns or t.first_step_ns
