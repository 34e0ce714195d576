"""Per-step batches of tokens for the router's Outputs streams (the gRPC process's side).

A router opens one ``Outputs`` stream per worker and names it (``subscriber_id``) in each
``StartDecode`` it sends; every engine step's outputs for all of that router's requests
(reservations, tokens, ends) then leave in one ``OutputBatch``, instead of one gRPC message
per token per request, and no per-request stream stays open.

Lifecycle of a subscriber (who moves it):

    open ──Outputs call starts (subscribe)──▶ live ──the call ends (unsubscribe)──▶ gone
                                               │ a new call with the same id replaces it
                                               ▼ (the old one is gone)

Lifecycle of a request's route: ``attach`` (its StartDecode named a live subscriber) ──its
finishing tokens are queued (``flush`` reports it ended)──▶ detached. A subscriber that goes
away hands back the requests still attached: the router that read them is gone, so the
servicer aborts them (nothing else would free their blocks). ``fail`` ends every subscriber
with an error (the engine failed, or the drain timed out): their readers see the stream end
with it once the batches already queued have gone.

A producer's request whose Prefill named a live subscriber is attached for its token 0
only (``attach_token0``): the token leaves in that subscriber's next batch (``token0s``),
with the step's other token 0s, and the request is detached at once; the Prefill stream
carries only the transfer's result. If the subscriber is gone by then, or the token ends
the request (the Prefill stream then ends with no result, and an end must not overtake its
token), ``add_token0`` declines and the Prefill stream carries token 0 as before. These
requests are not counted in ``running`` and are not handed back when their subscriber goes:
their own Prefill stream ends them.

A producer's request started with ``StartPrefill`` (``attach_prefill``) has no stream of its
own: it is attached like a consumer's, counted in ``running`` and handed back with its
subscriber. Its token 0 always goes to the subscriber (``add_token0``; one that ends the
request ends its route there), then its transfer's result (``add_transfer``), which ends it.

Nothing here waits on the engine-process pump: ``add`` and ``flush`` only append. A reader
that falls behind gets its queued batches merged into one message (lossless, in order), so
its backlog costs fewer, larger writes rather than more memory per batch.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from dataclasses import dataclass
from typing import Protocol

from pdserve.v1 import worker_pb2

from worker.convert import add_tokens, fill_token0, finish_reason_pb, token_logprob
from worker.messages import ReservedEvent, Token0Event, TransferResultEvent
from worker.token_batch import TokensBatchEvent, TokensEvent

MAX_SUBSCRIBER_ID = 256  # bytes; a router's id is a uuid and a counter
# How long a StartDecode waits for the subscriber it names to open (the router opens the
# stream just before its first request to a worker, so the two may cross).
SUBSCRIBE_WAIT_S = 5.0


@dataclass(frozen=True)
class OutputsDone:
    """A request whose last tokens left in batch ``seq`` (for the servicer's count; not an
    IPC message: it never leaves the gRPC process)."""

    rid: str
    seq: int
    # the engine's finish reason ("stop", "length", "abort", "error"); for a StartPrefill
    # request the Prefill outcome ("transferred", "busy", "transfer_failed", or token 0's
    # finish reason)
    finish: str
    prefill: bool = False  # a StartPrefill request's end


@dataclass(frozen=True)
class Token0Routed:
    """A producer's token 0 that left on an Outputs stream (``OutputHub.add_token0``): its
    Prefill stream sends nothing for it (not an IPC message: it never leaves the gRPC
    process)."""

    event: Token0Event


class SubscriberFailed(Exception):
    """The worker ended every Outputs stream with this error (``OutputHub.fail``)."""


class Sink(Protocol):
    """A stream that can take a batch at once, inside the hub's flush (the plain Outputs
    port's socket: worker/outputs_port.py), instead of waking its writer task for it."""

    def ready(self) -> bool:
        """It would write now (not closing, not past its backpressure mark)."""
        ...

    def write(self, batch: worker_pb2.OutputBatch) -> None: ...


class Subscriber:
    """One router's Outputs stream: the batch its reader takes next.

    A step's outputs are written straight into the message that will carry them
    (``pending``), so each entry is built once. While the reader has not yet taken the
    batch queued before (its write is still in flight), the next step's entries go into
    that same message, after the earlier ones: a reader that falls behind gets one larger
    message, in order, and nothing is copied to merge it.
    """

    def __init__(self, subscriber_id: str) -> None:
        self.subscriber_id = subscriber_id
        self.seq = 0  # the last batch queued (0: none yet; the stream opens with seq 0)
        self.pending = worker_pb2.OutputBatch()  # the message the reader takes next
        self.npending = 0  # entries the current step wrote into it (not yet queued)
        self.rids: set[str] = set()  # requests attached to it
        self.closed = False
        self.failed = ""  # set: the stream ends with this error once its queue is empty
        self._queued = False  # pending holds queued steps the reader has not taken
        self._ready = asyncio.Event()
        # Set by a reader parked in next_batch whose stream can write synchronously: a
        # queued step then leaves inside the flush that queued it, with no task wake-up
        # between (the first-token hold's "writer took" part; a step's CPU on both ends)
        self.sink: Sink | None = None

    @property
    def has_queued(self) -> bool:
        """A batch waits for the reader (the stream has not taken it yet)."""
        return self._queued

    async def next_batch(self) -> worker_pb2.OutputBatch:
        """Everything queued since the last call, as one message (waits for something);
        SubscriberFailed once the queue is empty and the hub failed it."""
        while not self._queued:
            if self.failed:
                raise SubscriberFailed(self.failed)
            self._ready.clear()
            await self._ready.wait()
        return self._take()

    def _take(self) -> worker_pb2.OutputBatch:
        # steps write and queue in one synchronous pass (EngineBridge._drain), so the
        # message taken here never holds part of a step
        batch = self.pending
        self.pending = worker_pb2.OutputBatch()
        self._queued = False
        if batch.token0s:  # a producer's: the hold's split between this wait and the wire
            now = time.time_ns()
            for t0 in batch.token0s:
                t0.taken_ns = now
        return batch

    def _queue_pending(self) -> int:
        self.seq += 1
        self.pending.seq = self.seq
        self._queued = True
        self.npending = 0
        sink = self.sink
        if sink is not None and sink.ready():
            sink.write(self._take())  # the parked reader stays parked
        else:
            self._ready.set()
        return self.seq

    def _drop_pending(self) -> None:
        self.pending = worker_pb2.OutputBatch()
        self._queued = False
        self.npending = 0


class OutputHub:
    def __init__(self) -> None:
        self.subscribers: dict[str, Subscriber] = {}
        self._owner: dict[str, Subscriber] = {}  # rid -> where its tokens go
        self._token0_owner: dict[str, Subscriber] = {}  # producer's rid -> where token 0 goes
        self._prefills: set[str] = set()  # attached rids started with StartPrefill
        self._dirty: list[Subscriber] = []  # subscribers with pending tokens
        # (rid, finish, sub, a StartPrefill request?)
        self._finishing: list[tuple[str, str, Subscriber, bool]] = []
        self._opened = asyncio.Event()  # set whenever a subscriber opens (StartDecode waits)
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
            self._prefills.discard(rid)
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

    def fail(self, error: str) -> None:
        """Ends every subscriber with ``error`` after what it has queued; its requests are
        detached (their reader learns the error from the stream's end)."""
        self._finishing.clear()
        self._token0_owner.clear()  # their Prefill streams end with the engine's failure
        self._prefills.clear()
        for sub in list(self.subscribers.values()):
            sub.failed = error
            for rid in sub.rids:
                self._owner.pop(rid, None)
            sub.rids.clear()
            if sub.npending:  # what the engine said before it failed still goes out
                sub._queue_pending()
            sub._ready.set()
        self._dirty.clear()

    # -- requests --------------------------------------------------------------------------

    @property
    def running(self) -> int:
        """Requests attached to a subscriber (started, not yet finished)."""
        return len(self._owner)

    def attach(self, rid: str, sub: Subscriber) -> None:
        self._owner[rid] = sub
        sub.rids.add(rid)

    def attach_prefill(self, rid: str, sub: Subscriber) -> None:
        """A StartPrefill request: its token 0 and transfer result go to ``sub``."""
        self.attach(rid, sub)
        self._prefills.add(rid)

    def detach(self, rid: str) -> None:
        self._token0_owner.pop(rid, None)
        self._prefills.discard(rid)
        sub = self._owner.pop(rid, None)
        if sub is not None:
            sub.rids.discard(rid)

    def attach_token0(self, rid: str, sub: Subscriber) -> None:
        """A producer's request: its token 0 goes to ``sub`` (``add_token0``)."""
        self._token0_owner[rid] = sub

    def add_token0(self, ev: Token0Event) -> bool:
        """Queues a producer's token 0 for its subscriber's next batch; False when it has
        none, that one is gone, or the token ends a Prefill stream's request (that stream
        carries token 0 then). A Prefill stream's request is detached at once; a
        StartPrefill one stays attached for its transfer's result, unless its token 0 ended
        it."""
        if ev.rid in self._prefills:
            sub = self._owner[ev.rid]
            if ev.finish:
                self._end_prefill(ev.rid, str(ev.finish), sub)
        else:
            stream_sub = self._token0_owner.pop(ev.rid, None)
            if stream_sub is None or stream_sub.closed or stream_sub.failed or ev.finish:
                return False
            sub = stream_sub
        self._dirty_entry(sub)
        fill_token0(sub.pending.token0s.add(request_id=ev.rid), ev, time.time_ns())
        return True

    def add_transfer(self, ev: TransferResultEvent) -> bool:
        """Queues a StartPrefill request's transfer result, its last entry; False when the
        request is not one (its Prefill stream carries the result)."""
        if ev.rid not in self._prefills:
            return False
        sub = self._owner[ev.rid]
        self._end_prefill(ev.rid, "transferred" if ev.ok else
                          "busy" if ev.busy else "transfer_failed", sub)
        self._dirty_entry(sub)
        sub.pending.transfers.add(request_id=ev.rid, ok=ev.ok, error=ev.error,
                                  kv_transfer_ms=ev.kv_transfer_ms, busy=ev.busy)
        return True

    def _end_prefill(self, rid: str, outcome: str, sub: Subscriber) -> None:
        self._prefills.discard(rid)
        del self._owner[rid]
        sub.rids.discard(rid)
        self._finishing.append((rid, outcome, sub, True))

    def _dirty_entry(self, sub: Subscriber) -> None:
        """One more entry in ``sub``'s pending batch (queued at the pass's flush)."""
        if not sub.npending:
            self._dirty.append(sub)
        sub.npending += 1

    def prefilling(self, rid: str) -> bool:
        """``rid`` is a StartPrefill request still attached here."""
        return rid in self._prefills

    def owns(self, rid: str) -> bool:
        return rid in self._owner

    def add_reserved(self, ev: ReservedEvent) -> bool:
        """Queues a consumer's reservation for its subscriber's next batch; False when the
        request has none (its Decode stream carries it)."""
        sub = self._owner.get(ev.rid)
        if sub is None:
            return False
        if not sub.npending:
            self._dirty.append(sub)
        sub.npending += 1
        r = sub.pending.reserved.add()
        r.request_id = ev.rid
        r.kv_address = ev.kv_address
        r.block_ids.extend(ev.block_ids)
        if ev.cached_blocks:
            r.cached_blocks = ev.cached_blocks
        return True

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
            self._finishing.append((ev.rid, ev.finish or "", sub, False))
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
        for i, kv_ready, first_step, cached, sent, seen, done in zip(
                b.timed, b.kv_ready_ns, b.first_step_ns, b.cached_tokens, b.notice_sent_ns,
                b.notice_seen_ns, b.kv_done_ns, strict=True):
            if (t := entries[i]) is not None:
                if kv_ready:  # the handoff's other stamps come with it
                    t.kv_ready_ns = kv_ready
                    t.notice_sent_ns, t.notice_seen_ns, t.kv_done_ns = sent, seen, done
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
                self._finishing.append((rid, finish, sub, False))
        return rest

    def flush(self) -> list[OutputsDone]:
        """Ends the step: one batch per subscriber that got outputs. Returns one OutputsDone
        per request that finished in it."""
        seqs: dict[int, int] = {}
        for sub in self._dirty:
            if not sub.closed:
                self.tokens += sub.npending
                self.batches += 1
                seqs[id(sub)] = sub._queue_pending()
            else:
                sub._drop_pending()
        self._dirty.clear()
        done = [OutputsDone(rid, seqs[id(sub)], finish, prefill)
                for rid, finish, sub, prefill in self._finishing if id(sub) in seqs]
        self._finishing.clear()
        return done
