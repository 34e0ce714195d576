"""One request's events between the engine-process pump and its gRPC stream, bounded.

The pump must never wait (it serves every request), so a full queue cannot push back on
it. Instead: token events are merged into the last queued one (lossless: ids, text and
logprobs concatenated, so a slow reader gets fewer, larger messages), and anything else
arriving at a full queue fails the request with a FatalEvent saying so. Either way, what
a request holds here is at most `max_events` messages, and nothing is dropped silently.
"""

from __future__ import annotations

import asyncio
import collections
from dataclasses import replace

from worker.messages import Event, FatalEvent
from worker.output_hub import Token0Routed
from worker.token_batch import TokensEvent

# what a request's stream reads: the engine's events, and the note that its token 0 left on
# an Outputs stream instead
Item = Event | Token0Routed

MAX_EVENTS = 64  # per request; a request emits a handful besides its token events


class RequestQueue:
    def __init__(self, rid: str, max_events: int = MAX_EVENTS) -> None:
        if max_events < 2:
            raise ValueError(f"max_events: must be >= 2, got {max_events}")
        self.rid = rid
        self.max_events = max_events
        self.merged = 0  # token events merged into an earlier one (the reader lagged)
        self.overflowed = False
        self._items: collections.deque[Item] = collections.deque()
        self._ready = asyncio.Event()

    def qsize(self) -> int:
        return len(self._items)

    def put_nowait(self, ev: Item) -> None:
        if self.overflowed:
            return  # already failed; its FatalEvent is queued
        items = self._items
        if len(items) < self.max_events:
            items.append(ev)
        elif isinstance(ev, TokensEvent) and _mergeable(items[-1]):
            items[-1] = _merge(items[-1], ev)  # type: ignore[arg-type]
            self.merged += 1
        else:
            self.overflowed = True
            items.clear()
            items.append(FatalEvent(f"request {self.rid}: its reader fell {self.max_events} "
                                    f"events behind; the request was ended"))
        self._ready.set()

    async def get(self) -> Item:
        while not self._items:
            self._ready.clear()
            await self._ready.wait()
        return self._items.popleft()


def _mergeable(ev: Item) -> bool:
    return isinstance(ev, TokensEvent) and not ev.finish and not ev.error


def _merge(a: TokensEvent, b: TokensEvent) -> TokensEvent:
    return replace(a, ids=a.ids + b.ids, text=a.text + b.text, logprobs=a.logprobs + b.logprobs,
                   finish=b.finish, stop_reason=b.stop_reason, error=b.error,
                   kv_ready_ns=a.kv_ready_ns or b.kv_ready_ns,
                   first_step_ns=a.first_step_ns or b.first_step_ns,
                   notice_sent_ns=a.notice_sent_ns or b.notice_sent_ns,
                   notice_seen_ns=a.notice_seen_ns or b.notice_seen_ns,
                   kv_done_ns=a.kv_done_ns or b.kv_done_ns)
