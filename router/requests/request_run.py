"""One request in flight: the object that creates, pairs, watches and tears down its legs.

Disaggregated, a request has two legs under one request id: the consumer's ``Decode``
stream (reservation, then tokens 1..n) and the producer's bidirectional ``Prefill`` stream
(token 0, then the KV transfer's result). Both start together; when the consumer reports
its reserved blocks the run forwards them to the producer (the *pairing* step, ``_pair``).
Colocated, one ``Decode`` stream carries tokens 0..n.

Lifecycle, router side: ``RunPhase`` (router/requests/run_phase.py, which draws it and
holds its edge table); every change goes through ``advance`` (forward, never back) or
``_place_legs`` (a new placement, the only backward edge), both checked.

Retry and migration (router/requests/run_recovery.py): a producer that fails before token 0 is
replaced, up to ``prefill_retries`` times, never by one it failed on; the failed attempt's
legs are cancelled and aborted (the consumer's reservation too, see ``_repair``), the new
legs use a new worker-side id (``leg_id``). Any other worker failure (a consumer dying
mid-decode or ending its stream early, a failed KV transfer, a dropped worker, silence past
a timeout) migrates the request, up to ``max_migrations`` times, to a slot avoiding every
worker that failed it, with the tokens its client already has as ``prior_output_ids``: the
new legs prefill prompt + those and go on after them as OUTPUT positions (penalties,
min/max_tokens, stop strings and the (seed, position) draws as in the unfailed run), so the
client's stream just goes on. The KV is recomputed, never salvaged from the failed worker.

Who moves it: the dispatcher creates the run (QUEUED) and places it (``place``); from
then on the client loop (``stream`` and the loops of run_streams.py) moves it as it hands
each leg's report on, so the phase is what the client has been given, and the loops'
questions (has token 0 gone out? has the consumer started?) are read from it. The legs'
reports reach the loop through one queue (``_on_report``); the consumer's reservation is
also forwarded to the producer there and then, without waiting for the client.

Timeouts: QUEUED is bounded by the admission queue (``--max-queued-requests``) and the
client's deadline; PLACED and PAIRED by ``token0_timeout_s`` for token 0; TOKEN0 and
KV_LANDED by ``token0_timeout_s`` again for the consumer's first token (it covers a queued
reservation and the KV transfer); DECODING by ``token_timeout_s`` between tokens; past a
bound, the silent worker counts as failed (migration). The workers guard their side
themselves (the producer's lease on blocks held for a consumer, the consumer's
reservation deadline).

Teardown (``close``) runs on every exit (finish, error, abort, the client gone, shutdown).
A leg that did its part (the producer once the transfer result came or token 0 finished
the request; a decoding leg that sent its last tokens) may close its stream by itself
within ``LINGER_S``; every other leg is cancelled and gets ``Worker.Abort``. Cancels are
synchronous and the aborts and lingers run as background tasks (``spawn``), so a client
that hangs up still frees blocks on both legs.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable, Coroutine
from typing import Any

import grpc
from pdserve.v1 import common_pb2, router_pb2, worker_pb2, worker_pb2_grpc

from router.config import RouterConfig
from router.control.dp_placement import attention_tp, pick_dp_rank
from router.control.policy import Slot
from router.control.registry import WorkerInfo
from router.requests.direct_write import DirectWrite
from router.requests.errors import Overloaded
from router.requests.event_queue import EventQueue, is_open
from router.requests.legs import DecodeLeg, abort_on_worker
from router.requests.producer_leg import ProducerLeg
from router.requests.request_info import RequestInfo
from router.requests.run_events import (
    STOPS,
    Aborted,
    Dropped,
    Event,
    Failed,
    Reserved,
    TimedOut,
    Token0Read,
    Token0Written,
    TokensRead,
)
from router.requests.run_output import RunOutput
from router.requests.run_phase import RunPhase, check_phase
from router.requests.run_recovery import Recovery
from router.requests.run_streams import colocated_stream, disaggregated_stream
from router.requests.validation import PreparedRequest
from router.requests.worker_outputs import WorkerOutputs

log = logging.getLogger(__name__)

P = RunPhase
DECODING = RunPhase.DECODING
# How long a leg that did its part may take to close its stream before the router cancels it.
LINGER_S = 5.0
FINISHED = {
    common_pb2.FINISH_REASON_STOP: P.FINISHED_STOPPED,
    common_pb2.FINISH_REASON_LENGTH: P.FINISHED_LENGTH,
    common_pb2.FINISH_REASON_ABORT: P.FINISHED_ABORTED,
    common_pb2.FINISH_REASON_ERROR: P.FINISHED_ERROR,
}
Spawn = Callable[[Coroutine[Any, Any, None]], None]


class RequestRun:
    def __init__(self, prep: PreparedRequest, received_ns: int, config: RouterConfig, *,
                 stub_for: Callable[[WorkerInfo], worker_pb2_grpc.WorkerStub],
                 outputs_for: Callable[[WorkerInfo], WorkerOutputs | None] = lambda w: None,
                 on_unreachable: Callable[[WorkerInfo, str], None], spawn: Spawn,
                 replace: Callable[[list[WorkerInfo], bool], Slot | None],
                 direct: DirectWrite | None = None) -> None:
        """direct: the client's gRPC stream, for decoding tokens written from the worker's
        batch (``_on_report``); None: every message goes through the client loop."""
        self.prep = prep
        self.config = config
        self.out = RunOutput(prep, received_ns)
        self.phase = P.QUEUED
        self.slot: Slot | None = None
        self.stubs: dict[str, worker_pb2_grpc.WorkerStub] = {}
        self.producer: ProducerLeg | None = None
        self.decode: DecodeLeg | None = None
        self.ended: set[str] = set()  # worker ids whose leg finished its part
        self._stub_for = stub_for
        # a worker's Outputs stream (None: Decode streams carry the tokens)
        self._outputs_for = outputs_for
        # a new slot avoiding the given workers, for a retry (False) or a migration (True)
        self._replace = replace
        self.recovery = Recovery(config.prefill_retries, config.max_migrations)
        self._on_unreachable = on_unreachable
        self._spawn = spawn
        self._received = time.monotonic()
        self._queue = EventQueue()  # legs' reports; waiting token messages coalesce
        self._direct = direct
        self.stopped = asyncio.Event()  # aborted or failed from outside (ends a queued wait)
        self._pairing: asyncio.Task[None] | None = None
        self._closed = False  # torn down: legs ended, no more pairing

    @property
    def request_id(self) -> str:
        return self.prep.request_id

    @property
    def completed(self) -> bool:
        """A leg finished the request (not the router, not an error)."""
        return self.phase in (P.FINISHED_STOPPED, P.FINISHED_LENGTH)

    def advance(self, phase: RunPhase) -> None:
        """Moves forward to ``phase``; a report that would move it back changes nothing."""
        if phase > self.phase and not self.phase.finished:
            self._move(phase)

    def _move(self, phase: RunPhase) -> None:
        check_phase(self.phase, phase)
        self.phase = phase

    def info(self) -> RequestInfo:
        t = self.out.timing
        return RequestInfo(self.request_id, self.phase, time.monotonic() - self._received,
                           t.producer, t.consumer, t.colocated, self.out.completion_tokens)

    @property
    def attempt(self) -> int:
        return self.recovery.attempt

    @property
    def leg_id(self) -> str:
        """The id the workers know this attempt by: a retry must not meet what the failed
        attempt left on a worker (a reservation being freed, a stream being torn down)."""
        rid = self.prep.request_id
        return rid if self.attempt == 1 else f"{rid}#retry{self.attempt - 1}"

    def post(self, event: Event) -> None:
        """From outside the legs: Router.Abort, a dropped worker, shutdown."""
        self._queue.put_nowait(event)
        if isinstance(event, STOPS):
            self.stopped.set()

    def place(self, slot: Slot) -> None:
        # Stubs are bound now: a worker dropped mid-request still gets its Abort on the
        # channel this request used.
        self.slot = slot
        self.stubs.update({w.worker_id: self._stub_for(w) for w in slot.workers})
        for w in slot.workers:
            w.inflight += 1
            w.dispatched += 1

    def _unplace(self) -> None:
        if self.slot is not None:
            for w in self.slot.workers:
                w.inflight -= 1

    # -- the legs --------------------------------------------------------------------------

    def _start_legs(self) -> None:
        slot, prep, t = self.slot, self.prep, self.out.timing
        assert slot is not None
        rec, attempt, on_report = self.recovery, self.attempt, self._on_report

        def report(ev: Event) -> None:  # once per token message: no property, no lookup
            if attempt == rec.attempt:  # a replaced attempt's legs have nothing to say
                on_report(ev)

        write_direct = self._write_direct

        def direct(t: worker_pb2.Tokens) -> bool:  # per token message, before any report
            return attempt == rec.attempt and write_direct(t)

        t.producer = slot.producer.worker_id if slot.producer else ""
        t.consumer = slot.consumer.worker_id if slot.consumer else ""
        t.colocated = slot.colocated.worker_id if slot.colocated else ""
        self.producer = None
        if slot.colocated is not None:
            w = slot.colocated
            req = self._decode_request(colocated=True)
            group = pick_dp_rank(w)
            if group is not None:
                req.dp_rank = group
            self.decode = DecodeLeg(w, self.stubs[w.worker_id], req, self._outputs_for(w),
                                    report)
            if self._direct is not None:
                self.decode.direct = direct
            self.decode.start()
            self._move(P.PLACED)
            return
        p, c = slot.producer, slot.consumer
        assert p is not None and c is not None
        self.producer = ProducerLeg(p, self.stubs[p.worker_id], report, self._outputs_for(p))
        # (producer, group) pairs with (consumer, group): the KV moves between those two
        # attention data-parallel groups' ranks only
        dreq = self._decode_request(colocated=False)
        preq = worker_pb2.PrefillRequest(
            request_id=self.leg_id, prompt_token_ids=prep.prompt_token_ids,
            sampling=prep.sampling, seed=prep.seed, prior_output_ids=self.out.token_ids,
            cache_salt=prep.cache_salt)
        for leg_req, w in ((dreq, c), (preq, p)):
            if (group := pick_dp_rank(w)) is not None:
                leg_req.dp_rank = group
        self.decode = DecodeLeg(c, self.stubs[c.worker_id], dreq, self._outputs_for(c),
                                report)
        if self._direct is not None:
            self.decode.direct = direct
        # Decode first: the reservation is the slower path, so it should not start late.
        self.decode.start()
        self.producer.start(preq,
                            hold=(self.decode, self.config.hold_interval_s, lambda: self._closed))
        self._move(P.PLACED)

    def _on_report(self, ev: Event) -> None:
        """Every leg's report lands here first and goes on to the client loop; the
        consumer's reservation also goes on to the producer at once.

        The steady state skips the loop: a decoding request's tokens that neither end nor
        fail it, arriving while the client loop waits with nothing in hand and no write is
        in flight, are written to the client's gRPC stream from here, within the pass over
        the worker's batch (``DirectWrite``). Anything else, or tokens that arrive while a
        write is still in flight, queue for the loop, which merges what waits together:
        the order of the client's messages is the order of the reports either way.
        """
        if type(ev) is TokensRead and is_open(ev.tokens) and self._write_direct(ev.tokens):
            return
        if type(ev) is Token0Read and self._write_token0_direct(ev):
            self._queue.put_nowait(Token0Written())  # the loop catches up behind it
            return
        if isinstance(ev, Reserved):
            if self.producer is None or self._closed:
                return
            self._pairing = _spawn(self._pair(ev.dest))
        self._queue.put_nowait(ev)

    def _write_direct(self, tokens: worker_pb2.Tokens) -> bool:
        """Writes a decoding request's tokens that go on (no finish: the caller checked)
        to the client's stream now, if the client loop waits with nothing in hand and no
        write is in flight; False: they go through the loop. Called by the decoding leg per
        token message before any report is made (``DecodeLeg.direct``), and by
        ``_on_report`` for a Decode stream's tokens."""
        d = self._direct
        if (d is None or self.phase is not DECODING or not d.idle or tokens.error
                or not self._queue.parked() or self._closed):
            return False
        resp, n = self.out.more(tokens)
        d.observe(n)
        d.start(resp)
        self._queue.touch()  # the loop's wait for the next token starts over
        return True

    def _write_token0_direct(self, ev: Token0Read) -> bool:
        """Writes the producer's token 0 to the client's stream now, from the pass over the
        producer's batch, when the client loop waits for it with nothing in hand; False: it
        goes through the loop. Through the loop, it waits for the wake-up of the client's
        task behind everything else ready: at hundreds of streams, the consumer's batch
        just handed on (bench/RESULTS.md, the first-token hold's "router sent" part). Not a
        token 0 that ends the request (the loop's final message), nor a migrated request's
        (its client has tokens: the loop decides), nor on a stream whose first message is
        its handler's (SSE)."""
        d = self._direct
        if (d is None or not d.takes_first or not d.idle or ev.token0.finish_reason
                or self.phase not in (P.PLACED, P.PAIRED) or self.out.completion_tokens
                or not self._queue.parked() or self._closed):
            return False
        resp = self.out.token0(ev.token0, ev.read_ns)
        self.advance(P.TOKEN0)
        d.observe(1)
        d.start(resp)
        return True

    async def _pair(self, dest: worker_pb2.KVDestination) -> None:
        """Tells the producer where the consumer's blocks are, then half-closes its input."""
        assert self.producer is not None
        await self.producer.send_destination(dest)
        # the handoff's timing: a destination later than token 0 holds the notice back
        self.out.timing.router_destination_sent_ns = (self.producer.destination_sent_ns
                                                      or time.time_ns())

    # -- the client's stream ---------------------------------------------------------------

    async def stream(self) -> AsyncIterator[router_pb2.GenerateResponse]:
        """The client's responses; every way out of it tears the legs down."""
        try:
            if not self._queue.empty():  # aborted or failed while it was queued
                yield self._finishing(self.stop(self._queue.get_nowait()))
                return
            while True:
                self._start_legs()
                assert self.slot is not None
                colocated = self.slot.colocated is not None
                gen = colocated_stream(self) if colocated else disaggregated_stream(self)
                async for resp in gen:
                    yield self._finishing(resp)
                if self.recovery.reason is None:
                    return
                if (failed := self._repair()) is not None:
                    yield self._finishing(failed)
                    return
        finally:
            self.close()

    def _finishing(self, resp: router_pb2.GenerateResponse) -> router_pb2.GenerateResponse:
        if resp.finish_reason:  # set before the client can leave at the yield
            self._move(FINISHED[resp.finish_reason])
            if resp.error:
                resp.error = self.recovery.describe(resp.error)
        return resp

    def retry_after(self, p: WorkerInfo, why: str, held: list[worker_pb2.Tokens],
                    busy: bool = False) -> bool:
        """A producer failed (``busy``: refused, its queue full) before token 0: may the
        request go to another producer? Not once the client or the consumer has tokens
        (``held``) from this attempt."""
        return self.recovery.may_retry(p, why, bool(held or self.out.completion_tokens), busy)

    def migrate_after(self, w: WorkerInfo, why: str, code: grpc.StatusCode | None = None
                      ) -> bool:
        """A worker failed the request in any other way: may it move to another slot?"""
        self.note_unreachable(w, code, why)
        return self.recovery.may_migrate(w, why, self.stopped.is_set())

    def _repair(self) -> router_pb2.GenerateResponse | None:
        """Replaces the failed attempt's legs with a new placement; a final error if none.

        The consumer's reservation is not handed on: its KV receiver binds a reservation to
        the first producer that pushes into it and fails it when that producer goes silent,
        so the old consumer leg is aborted and the whole request is placed again (the same
        consumer may be picked; the new legs use a new ``leg_id``).
        """
        rec = self.recovery
        why, migrating, busy = rec.take()
        # a migration leaves alone a producer whose part is done (its blocks are freed)
        self._end_legs(self.legs_to_abort() if migrating else self._all_legs())
        self._unplace()
        # events of the failed attempt's legs are stale; the outside's (abort, shutdown) stay
        stale = []
        while not self._queue.empty():
            stale.append(self._queue.get_nowait())
        for ev in stale:
            if isinstance(ev, STOPS):
                self._queue.put_nowait(ev)
        slot = self._replace(rec.failed_on, migrating)
        if slot is None:
            self.slot = None
            if migrating:  # nowhere to go: the failure as it was
                return self.out.failed(why)
            if busy and not self.out.completion_tokens:  # nothing sent: a clean refusal
                raise Overloaded(f"{rec.no_slot(why)}; retry later",
                                 self.config.retry_after_s)
            return self.out.failed(rec.no_slot(why))
        if migrating:
            rec.migrations += 1
            log.warning("request %s: %s; migrating after %d token(s) to %s (migration %d of "
                        "%d)", self.request_id, why, len(self.out.token_ids),
                        "+".join(w.worker_id for w in slot.workers), rec.migrations,
                        self.config.max_migrations)
        else:
            log.warning("request %s: %s; retrying (attempt %d of %d)", self.request_id, why,
                        rec.attempt + 1, self.config.prefill_retries + 1)
        rec.attempt += 1
        self.ended = set()
        self.place(slot)
        return None

    # -- teardown --------------------------------------------------------------------------

    def close(self) -> None:
        """Ends both legs (idempotent; never awaits, so it runs in a cancelled handler)."""
        if not self.phase.finished:  # no final message went out: the client left
            self._move(P.FINISHED_ABORTED)
        if self._closed:
            return
        self._closed = True
        self._queue.close()
        if self.decode is not None and self.slot is not None:  # legs of a placement started
            self._end_legs(self.legs_to_abort())
        self._unplace()
        for leg in (self.decode, self.producer):  # no cycle back to the run (Leg.detach)
            if leg is not None:
                leg.detach()

    def _all_legs(self) -> list[WorkerInfo]:
        return self.slot.workers if self.slot is not None else []

    def _end_legs(self, to_abort: list[WorkerInfo]) -> None:
        for leg in (self.decode, self.producer):
            if leg is None:
                continue
            if leg.worker in to_abort:
                leg.cancel()
            elif leg.reading:
                self._spawn(leg.linger(LINGER_S))
        for w in to_abort:
            self._spawn(abort_on_worker(self.stubs[w.worker_id], w, self.leg_id,
                                        self.config.abort_timeout_s))

    def legs_to_abort(self) -> list[WorkerInfo]:
        """Workers that may still hold this request and must get Worker.Abort."""
        assert self.slot is not None
        return [w for w in self.slot.workers if w.worker_id not in self.ended
                # a producer that did its part half-closes and ends its stream by itself
                and not (w is self.slot.producer and self.completed)]

    # -- helpers ---------------------------------------------------------------------------

    def _decode_request(self, *, colocated: bool) -> worker_pb2.DecodeRequest:
        prep, p = self.prep, self.slot.producer if self.slot is not None else None
        return worker_pb2.DecodeRequest(request_id=self.leg_id,
                                        prompt_token_ids=prep.prompt_token_ids,
                                        sampling=prep.sampling, seed=prep.seed,
                                        colocated=colocated, prior_output_ids=self.out.token_ids,
                                        # TP pairing: the ranks of one attention group
                                        source_tp_size=attention_tp(p) if p else 0,
                                        cache_salt=prep.cache_salt,
                                        reuse_cached=self.slot is not None
                                        and self.slot.reuses_cache)

    async def next_event(self, timeout: float, what: str, waiting_on: WorkerInfo,
                         bound: float | None = None) -> Event:
        """The next report, or a TIMEOUT naming ``what`` and the bound it missed (``bound``
        when the wait is what is left of a longer one)."""
        ev = await self._queue.get(timeout)
        if ev is None:
            return TimedOut(waiting_on, f"no {what} within {bound or timeout:g} s")
        return ev

    def tokens(self, tokens: worker_pb2.Tokens, w: WorkerInfo
                ) -> tuple[router_pb2.GenerateResponse, str | None]:
        resp, error = self.out.tokens(tokens, w)
        if error is not None:
            self.ended.add(w.worker_id)
        return resp, error

    def leg_failed(self, w: WorkerInfo, code: grpc.StatusCode | None, msg: str
                    ) -> router_pb2.GenerateResponse:
        self.note_unreachable(w, code, msg)
        return self.out.failed(msg)

    def note_unreachable(self, w: WorkerInfo, code: grpc.StatusCode | None, msg: str) -> None:
        if code == grpc.StatusCode.UNAVAILABLE:
            # Unreachable: stop pairing with it now rather than at the heartbeat timeout;
            # if it is in fact alive, its next heartbeat is refused and it re-registers.
            self._on_unreachable(w, msg)

    def stop(self, ev: Event) -> router_pb2.GenerateResponse:
        """The final message for an event that ends the run from outside or by a bound."""
        match ev:
            case Aborted():
                return self.out.aborted()
            case Dropped(reason=why) | TimedOut(message=why) | Failed(message=why):
                return self.out.failed(why)
        raise AssertionError(f"{ev!r} does not stop a run")


def _spawn(coro: Coroutine[Any, Any, None]) -> asyncio.Task[None]:
    return asyncio.get_running_loop().create_task(coro)
