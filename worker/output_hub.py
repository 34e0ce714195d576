"""Per-step batches of tokens for the router's Outputs streams (the gRPC process's side).

A router opens one ``Outputs`` stream per worker and names it (``subscriber_id``) in each
``Decode`` it sends; every engine step's tokens for all of that router's requests then
leave in one ``OutputBatch``, instead of one gRPC message per token per request.

Lifecycle of a subscriber (who moves it):

    open ──Outputs call starts (subscribe)──▶ live ──the call ends (unsubscribe)──▶ gone
                                               │ a new call with the same id replaces it
                                               ▼ (the old one is gone)

Lifecycle of a request's route: ``attach`` (its Decode named a live subscriber) ──its
finishing tokens are queued (``flush`` reports (rid, seq))──▶ detached. A subscriber that
goes away hands back the requests still attached: the router that read them is gone, so the
servicer aborts them (nothing else would free their blocks).

Nothing here waits on the engine-process pump: ``add`` and ``flush`` only append. A reader
that falls behind gets its queued batches merged into one message (lossless, in order), so
its backlog costs fewer, larger writes rather than more memory per batch.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
from dataclasses import dataclass

from pdserve.v1 import worker_pb2

from worker.convert import add_tokens, finish_reason_pb, token_logprob
from worker.messages import TokensBatchEvent, TokensEvent

MAX_SUBSCRIBER_ID = 256  # bytes; a router's id is a uuid and a counter
# How long a Decode waits for the subscriber it names to open (the router opens the stream
# just before its first request to a worker, so the two may cross).
SUBSCRIBE_WAIT_S = 5.0


@dataclass(frozen=True)
class OutputsDone:
    """To a request's Decode stream: its last tokens left in batch ``seq`` (not an IPC
    message: it never leaves the gRPC process)."""

    rid: str
    seq: int
    finish: str  # the engine's finish reason ("stop", "length", "abort", "error")


class Subscriber:
    """One router's Outputs stream: batches waiting to be written, in seq order.

    A step's tokens are written straight into the batch message that will carry them
    (``pending``), so each token is built once; only batches that queued up behind a slow
    reader are copied, when they merge into one message.
    """

    def __init__(self, subscriber_id: str) -> None:
        self.subscriber_id = subscriber_id
        self.seq = 0  # the last batch queued (0: none yet; the stream opens with seq 0)
        self.pending = worker_pb2.OutputBatch()  # the current step's, not yet queued
        self.npending = 0  # Tokens entries in it
        self.rids: set[str] = set()  # requests attached to it
        self.closed = False
        self._queue: collections.deque[worker_pb2.OutputBatch] = collections.deque()
        self._ready = asyncio.Event()

    async def next_batch(self) -> worker_pb2.OutputBatch:
        """Everything queued since the last call, as one message (waits for something)."""
        while not self._queue:
            self._ready.clear()
            await self._ready.wait()
        batch = self._queue.popleft()
        while self._queue:  # the reader fell behind: one message for all of it, in order
            later = self._queue.popleft()
            batch.tokens.extend(later.tokens)
            batch.seq = later.seq
        return batch

    def _queue_pending(self) -> int:
        self.seq += 1
        batch = self.pending
        batch.seq = self.seq
        self._queue.append(batch)
        self.pending = worker_pb2.OutputBatch()
        self.npending = 0
        self._ready.set()
        return self.seq

    def _drop_pending(self) -> None:
        self.pending = worker_pb2.OutputBatch()
        self.npending = 0


class OutputHub:
    def __init__(self) -> None:
        self.subscribers: dict[str, Subscriber] = {}
        self._owner: dict[str, Subscriber] = {}  # rid -> where its tokens go
        self._dirty: list[Subscriber] = []  # subscribers with pending tokens
        self._finishing: list[tuple[str, str, Subscriber]] = []  # (rid, finish, sub)
        self._opened = asyncio.Event()  # set whenever a subscriber opens (Decode waits)
        self.batches = 0  # batches queued, all subscribers (metrics, tests)
        self.tokens = 0  # Tokens entries queued

    # -- subscribers -----------------------------------------------------------------------

    def subscribe(self, subscriber_id: str) -> tuple[Subscriber, list[str]]:
        """A new live subscriber, and the requests of the one it replaces (to abort)."""
        if not subscriber_id:
            raise ValueError("subscriber_id: required")
        if len(subscriber_id.encode()) > MAX_SUBSCRIBER_ID:
            raise ValueError(f"subscriber_id: longer than {MAX_SUBSCRIBER_ID} bytes")
        old = self.subscribers.get(subscriber_id)
        orphans = self.unsubscribe(old) if old is not None else []
        sub = Subscriber(subscriber_id)
        self.subscribers[subscriber_id] = sub
        self._opened.set()
        self._opened = asyncio.Event()
        return sub, orphans

    def unsubscribe(self, sub: Subscriber) -> list[str]:
        """The stream ended: the requests still attached (their reader is gone)."""
        if sub.closed:
            return []
        sub.closed = True
        if self.subscribers.get(sub.subscriber_id) is sub:
            del self.subscribers[sub.subscriber_id]
        orphans = sorted(sub.rids)
        for rid in orphans:
            self._owner.pop(rid, None)
        sub.rids.clear()
        return orphans

    async def wait_for(self, subscriber_id: str, timeout_s: float = SUBSCRIBE_WAIT_S
                       ) -> Subscriber | None:
        loop = asyncio.get_running_loop()
        end = loop.time() + timeout_s
        while (sub := self.subscribers.get(subscriber_id)) is None:
            left = end - loop.time()
            if left <= 0:
                return None
            try:
                await asyncio.wait_for(self._opened.wait(), left)
            except TimeoutError:
                return None
        return sub

    # -- requests --------------------------------------------------------------------------

    def attach(self, rid: str, sub: Subscriber) -> None:
        self._owner[rid] = sub
        sub.rids.add(rid)

    def detach(self, rid: str) -> None:
        sub = self._owner.pop(rid, None)
        if sub is not None:
            sub.rids.discard(rid)

    def owns(self, rid: str) -> bool:
        return rid in self._owner

    def add(self, ev: TokensEvent) -> bool:
        """Queues a request's tokens for its subscriber's next batch; False when it has none
        (its Decode stream carries them itself)."""
        sub = self._owner.get(ev.rid)
        if sub is None:
            return False
        if not sub.npending:
            self._dirty.append(sub)
        add_tokens(sub.pending.tokens, ev)
        sub.npending += 1
        if ev.finish:
            # its last message: no more tokens may follow on any stream
            self._owner.pop(ev.rid, None)
            sub.rids.discard(ev.rid)
            self._finishing.append((ev.rid, ev.finish or "", sub))
        return True

    def add_batch(self, b: TokensBatchEvent) -> list[int]:
        """``add`` for every request of a step's columnar message, each ``Tokens`` entry
        built in place from the columns. Returns the indices of the requests that have no
        subscriber (their Decode streams carry them)."""
        owner = self._owner
        dirty = self._dirty
        entries: list[worker_pb2.Tokens | None] = []
        rest: list[int] = []
        # Setting an entry's fields one by one is ~30% cheaper than add(**fields) (upb);
        # a decode step gives every request one token, the common case
        one_each = len(b.ids) == len(b.rids) and (not b.counts or min(b.counts) == 1)
        ids, texts = b.ids, b.texts
        starts = [] if one_each else list(itertools.accumulate(b.counts, initial=0))
        for i, rid in enumerate(b.rids):
            sub = owner.get(rid)
            if sub is None:
                rest.append(i)
                entries.append(None)
                continue
            if not sub.npending:
                dirty.append(sub)
            sub.npending += 1
            t = sub.pending.tokens.add()
            t.request_id = rid
            if one_each:
                t.token_ids.append(ids[i])
            elif starts[i] < starts[i + 1]:
                t.token_ids.extend(ids[starts[i]:starts[i + 1]])
            if text := texts[i]:
                t.text = text
            entries.append(t)
        for i, kv_ready, first_step, cached in zip(b.timed, b.kv_ready_ns, b.first_step_ns,
                                                   b.cached_tokens, strict=True):
            if (t := entries[i]) is not None:
                if kv_ready:
                    t.kv_ready_ns = kv_ready
                if first_step:
                    t.first_step_ns = first_step
                if cached:
                    t.cached_tokens = cached
        if b.lp_counts:
            for t, rows in zip(entries, b.logprob_rows(), strict=True):
                if t is not None and rows:
                    t.logprobs.extend([token_logprob(r) for r in rows])
        for i, finish, stop_reason, error in zip(b.ended, b.finishes, b.stop_reasons,
                                                 b.errors, strict=True):
            if (t := entries[i]) is None:
                continue
            if stop_reason:
                t.stop_reason = stop_reason
            if error:
                t.error = error
            if finish:
                t.finish_reason = finish_reason_pb(finish)
                rid = b.rids[i]  # its last message: no more tokens may follow on any stream
                sub = self._owner.pop(rid)
                sub.rids.discard(rid)
                self._finishing.append((rid, finish, sub))
        return rest

    def flush(self) -> list[OutputsDone]:
        """Ends the step: one batch per subscriber that got tokens. Returns one OutputsDone
        per request that finished in it (its Decode stream then ends with that seq)."""
        seqs: dict[int, int] = {}
        for sub in self._dirty:
            if not sub.closed:
                self.tokens += sub.npending
                self.batches += 1
                seqs[id(sub)] = sub._queue_pending()
            else:
                sub._drop_pending()
        self._dirty.clear()
        done = [OutputsDone(rid, seqs[id(sub)], finish) for rid, finish, sub in self._finishing
                if id(sub) in seqs]
        self._finishing.clear()
        return done
