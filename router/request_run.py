"""One request in flight: the object that creates, pairs, watches and tears down its legs.

Disaggregated, a request has two legs under one request id: the consumer's ``Decode``
stream (reservation, then tokens 1..n) and the producer's bidirectional ``Prefill`` stream
(token 0, then the KV transfer's result). Both start together; when the consumer reports
its reserved blocks the run forwards them to the producer (the *pairing* step, ``_pair``).
Colocated, one ``Decode`` stream carries tokens 0..n.

Lifecycle, router side (``engine.request_state.RequestState``)::

    QUEUED ──admitted and placed, legs started──▶ RESERVING ──consumer reserved──▶ PREFILLING
      │  (colocated: QUEUED ──▶ PREFILLING)          │ token 0 before the reservation   │ token 0
      │                                              ▼                                  ▼
      │                                         TRANSFERRING ◀──────────────────────────┘
      │                                              │ the producer's transfer result: ok
      │                                              ▼
      │                                        WAITING_FOR_KV ──first consumer token──▶ DECODING
      ▼                                                       (colocated: token 0 ──▶ DECODING)
    any state ──▶ FINISHED_STOPPED / FINISHED_LENGTH   the decoding leg (or token 0) finished it
              ──▶ FINISHED_ABORTED                     Router.Abort
              ──▶ FINISHED_ERROR                       a leg failed or ended early, a timeout,
                                                       its worker was dropped, router shutdown

Who moves it: the dispatcher creates the run (QUEUED) and places it (``place``); from
then on the legs' reports move it forward, the moment a leg reads a message
(``_on_report``), whether or not the client has read what came before; the client loop
(``stream``) decides how it ends. Forward moves never go back: a consumer token that
overtakes token 0 already means DECODING, and the late token 0 leaves it there.

Timeouts: QUEUED is bounded by the admission queue (``--max-queued-requests``) and the
client's deadline; RESERVING, PREFILLING and TRANSFERRING by ``token0_timeout_s`` for
token 0; WAITING_FOR_KV by ``token0_timeout_s`` again for the consumer's first token (it
covers a queued reservation and the KV transfer); DECODING by ``token_timeout_s`` between
tokens. The workers guard their side themselves (the producer's lease on blocks held for
a consumer, the consumer's reservation deadline).

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
from dataclasses import dataclass
from typing import Any

import grpc
from pdserve.v1 import common_pb2, router_pb2, worker_pb2, worker_pb2_grpc

from engine.request_state import RequestState
from router.config import RouterConfig
from router.legs import DecodeLeg, Ev, Event, ProducerLeg, abort_on_worker
from router.policy import Slot
from router.registry import WorkerInfo
from router.run_output import RunOutput
from router.validation import PreparedRequest

log = logging.getLogger(__name__)

S = RequestState
# How long a leg that already did its part may take to close its stream before the router
# cancels the call.
LINGER_S = 5.0
# The forward path; a report never moves a request backwards along it.
FORWARD = (S.QUEUED, S.RESERVING, S.PREFILLING, S.TRANSFERRING, S.WAITING_FOR_KV, S.DECODING)
FINISHED = {
    common_pb2.FINISH_REASON_STOP: S.FINISHED_STOPPED,
    common_pb2.FINISH_REASON_LENGTH: S.FINISHED_LENGTH,
    common_pb2.FINISH_REASON_ABORT: S.FINISHED_ABORTED,
    common_pb2.FINISH_REASON_ERROR: S.FINISHED_ERROR,
}
Spawn = Callable[[Coroutine[Any, Any, None]], None]


@dataclass(frozen=True)
class RequestInfo:
    """One request as listed by ClusterStatus and GET /debug/requests."""

    request_id: str
    state: RequestState
    age_s: float  # since the router received it
    producer: str  # worker ids of its legs ("" when none yet, or colocated)
    consumer: str
    colocated: str
    tokens_streamed: int  # tokens handed to the client so far


class RequestRun:
    def __init__(self, prep: PreparedRequest, received_ns: int, config: RouterConfig, *,
                 stub_for: Callable[[WorkerInfo], worker_pb2_grpc.WorkerStub],
                 on_unreachable: Callable[[WorkerInfo, str], None], spawn: Spawn) -> None:
        self.prep = prep
        self.config = config
        self.out = RunOutput(prep, received_ns)
        self.state = S.QUEUED
        self.slot: Slot | None = None
        self.stubs: dict[str, worker_pb2_grpc.WorkerStub] = {}
        self.producer: ProducerLeg | None = None
        self.decode: DecodeLeg | None = None
        self.ended: set[str] = set()  # worker ids whose leg finished its part
        self._stub_for = stub_for
        self._on_unreachable = on_unreachable
        self._spawn = spawn
        self._received = time.monotonic()
        self._queue: asyncio.Queue[Event] = asyncio.Queue()
        self._pairing: asyncio.Task[None] | None = None
        self._completed = False  # a leg finished the request (not the router, not an error)
        self._closed = False

    @property
    def request_id(self) -> str:
        return self.prep.request_id

    def info(self) -> RequestInfo:
        t = self.out.timing
        return RequestInfo(self.request_id, self.state, time.monotonic() - self._received,
                           t.producer, t.consumer, t.colocated, self.out.completion_tokens)

    def post(self, event: Event) -> None:
        """From outside the legs: Router.Abort, a dropped worker, shutdown."""
        self._queue.put_nowait(event)

    def place(self, slot: Slot) -> None:
        # Stubs are bound now: a worker dropped mid-request still gets its Abort on the
        # channel this request used.
        self.slot = slot
        self.stubs = {w.worker_id: self._stub_for(w) for w in slot.workers}

    # -- the legs --------------------------------------------------------------------------

    def _start_legs(self) -> None:
        slot, prep, t = self.slot, self.prep, self.out.timing
        assert slot is not None
        if slot.colocated is not None:
            w = slot.colocated
            t.colocated = w.worker_id
            self.decode = DecodeLeg(w, self.stubs[w.worker_id].Decode(
                self._decode_request(colocated=True)), self._on_report)
            self.decode.start()
            self._advance(S.PREFILLING)
            return
        p, c = slot.producer, slot.consumer
        assert p is not None and c is not None
        t.producer, t.consumer = p.worker_id, c.worker_id
        self.producer = ProducerLeg(p, self.stubs[p.worker_id].Prefill(), self._on_report)
        self.decode = DecodeLeg(c, self.stubs[c.worker_id].Decode(
            self._decode_request(colocated=False)), self._on_report)
        # Decode first: the reservation is the slower path, so it should not start late.
        self.decode.start()
        self.producer.start(worker_pb2.PrefillRequest(
            request_id=prep.request_id, prompt_token_ids=prep.prompt_token_ids,
            sampling=prep.sampling, seed=prep.seed))
        self._advance(S.RESERVING)

    def _on_report(self, ev: Event) -> None:
        """Every leg's report lands here first: the state moves now, then the client loop
        gets the event (and the reservation goes on to the producer)."""
        if ev.kind is Ev.RESERVED:
            if self.producer is not None and not self._closed:
                self._advance(S.PREFILLING)
                self._pairing = _spawn(self._pair(ev.payload))
            return
        if ev.kind is Ev.TOKEN0:
            self._advance(S.TRANSFERRING)
        elif ev.kind is Ev.TRANSFER and ev.payload.ok:
            self._advance(S.WAITING_FOR_KV)
        elif ev.kind is Ev.TOKENS and ev.payload.token_ids:
            self._advance(S.DECODING)
        self._queue.put_nowait(ev)

    async def _pair(self, dest: worker_pb2.KVDestination) -> None:
        """Tells the producer where the consumer's blocks are, then half-closes its input."""
        assert self.producer is not None
        await self.producer.send_destination(dest)

    def _advance(self, state: RequestState) -> None:
        if self.state in FORWARD and FORWARD.index(state) > FORWARD.index(self.state):
            self.state = state

    # -- the client's stream ---------------------------------------------------------------

    async def stream(self) -> AsyncIterator[router_pb2.GenerateResponse]:
        """The client's responses; every way out of it tears the legs down."""
        try:
            if not self._queue.empty():  # aborted or failed while it was queued
                yield self._finishing(self._stop(self._queue.get_nowait()))
                return
            self._start_legs()
            assert self.slot is not None
            gen = self._colocated() if self.slot.colocated is not None else self._disaggregated()
            async for resp in gen:
                yield self._finishing(resp)
        finally:
            self.close()

    def _finishing(self, resp: router_pb2.GenerateResponse) -> router_pb2.GenerateResponse:
        if resp.finish_reason:  # set before the client can leave at the yield
            self.state = FINISHED[resp.finish_reason]
        return resp

    async def _disaggregated(self) -> AsyncIterator[router_pb2.GenerateResponse]:
        assert self.slot is not None
        p, c = self.slot.producer, self.slot.consumer
        assert p is not None and c is not None
        cfg, out = self.config, self.out
        token0_sent = transferred = consumer_started = False
        held: list[worker_pb2.Tokens] = []  # consumer tokens that overtook token 0
        while True:
            if not token0_sent:
                ev = await self._next(cfg.token0_timeout_s, f"token 0 from producer {p.worker_id}")
            elif not consumer_started:
                # Includes a queued reservation and the KV transfer, hence the long bound.
                ev = await self._next(cfg.token0_timeout_s,
                                      f"first token from consumer {c.worker_id}")
            else:
                ev = await self._next(cfg.token_timeout_s,
                                      f"next token from consumer {c.worker_id}")
            if ev.kind is Ev.TOKEN0:
                t0: worker_pb2.Token0 = ev.payload
                resp = out.token0(t0)
                token0_sent = True
                if t0.finish_reason:
                    self._completed = True
                    yield out.final(resp, t0.finish_reason, t0.stop_reason)
                    return
                yield resp
                for tokens in held:
                    resp, error = self._tokens(tokens, c)
                    yield resp
                    if error is not None:
                        return
                held.clear()
            elif ev.kind is Ev.TOKENS:
                consumer_started = True
                if not token0_sent:
                    held.append(ev.payload)
                    if ev.payload.finish_reason:
                        self.ended.add(c.worker_id)  # its stream's end is no failure
                    continue
                resp, error = self._tokens(ev.payload, c)
                yield resp
                if error is not None:
                    return
            elif ev.kind is Ev.TRANSFER:
                tr: worker_pb2.TransferResult = ev.payload
                out.timing.kv_transfer_ms = tr.kv_transfer_ms
                self.ended.add(p.worker_id)  # the producer is done with this request
                if not tr.ok:
                    yield out.failed(f"KV transfer from producer {p.worker_id} to consumer "
                                     f"{c.worker_id} failed: {tr.error or 'no details'}")
                    return
                transferred = True
            elif ev.kind is Ev.PRODUCER_EOF:
                self.ended.add(p.worker_id)
                if not token0_sent:
                    yield out.failed(f"producer {p.worker_id} ended its stream before token 0")
                    return
                if not transferred:
                    yield out.failed(f"producer {p.worker_id} ended its stream without a KV "
                                     f"transfer result")
                    return
            elif ev.kind is Ev.DECODE_EOF:
                if c.worker_id in self.ended:
                    continue  # finished; its last tokens wait in ``held`` for token 0
                self.ended.add(c.worker_id)
                yield out.failed(f"consumer {c.worker_id} ended its stream before the request "
                                 f"finished")
                return
            elif ev.kind is Ev.LEG_ERROR:
                worker, code, msg = ev.payload
                if worker.worker_id in self.ended:
                    continue  # it did its part (the KV landed / last tokens are held)
                yield self._leg_failed(worker, code, msg)
                return
            else:
                yield self._stop(ev)
                return

    async def _colocated(self) -> AsyncIterator[router_pb2.GenerateResponse]:
        assert self.slot is not None
        w = self.slot.colocated
        assert w is not None
        started = False
        while True:
            if not started:
                ev = await self._next(self.config.token0_timeout_s,
                                      f"token 0 from colocated worker {w.worker_id}")
            else:
                ev = await self._next(self.config.token_timeout_s,
                                      f"next token from colocated worker {w.worker_id}")
            if ev.kind is Ev.TOKENS:
                tokens: worker_pb2.Tokens = ev.payload
                if not started and tokens.token_ids:
                    started = True
                    self.out.timing.router_token0_sent_ns = time.time_ns()
                resp, error = self._tokens(tokens, w)
                yield resp
                if error is not None:
                    return
            elif ev.kind is Ev.DECODE_EOF:
                self.ended.add(w.worker_id)
                yield self.out.failed(f"colocated worker {w.worker_id} ended its stream before "
                                      f"the request finished")
                return
            elif ev.kind is Ev.LEG_ERROR:
                worker, code, msg = ev.payload
                yield self._leg_failed(worker, code, msg)
                return
            else:
                yield self._stop(ev)
                return

    # -- teardown --------------------------------------------------------------------------

    def close(self) -> None:
        """Ends both legs (idempotent; never awaits, so it runs in a cancelled handler)."""
        if self.state in FORWARD:  # no final message went out: the client left
            self.state = S.FINISHED_ABORTED
        if self._closed or self.decode is None:  # closed already, or no leg ever started
            self._closed = True
            return
        self._closed = True
        to_abort = self.legs_to_abort()
        for leg in (self.decode, self.producer):
            if leg is None:
                continue
            if leg.worker in to_abort:
                leg.cancel()
            elif leg.reading:
                self._spawn(leg.linger(LINGER_S))
        for w in to_abort:
            self._spawn(abort_on_worker(self.stubs[w.worker_id], w, self.request_id,
                                        self.config.abort_timeout_s))

    def legs_to_abort(self) -> list[WorkerInfo]:
        """Workers that may still hold this request and must get Worker.Abort."""
        assert self.slot is not None
        return [w for w in self.slot.workers if w.worker_id not in self.ended
                # a producer that did its part half-closes and ends its stream by itself
                and not (w is self.slot.producer and self._completed)]

    # -- helpers ---------------------------------------------------------------------------

    def _decode_request(self, *, colocated: bool) -> worker_pb2.DecodeRequest:
        prep = self.prep
        return worker_pb2.DecodeRequest(request_id=prep.request_id,
                                        prompt_token_ids=prep.prompt_token_ids,
                                        sampling=prep.sampling, seed=prep.seed,
                                        colocated=colocated)

    async def _next(self, timeout: float, what: str) -> Event:
        try:
            async with asyncio.timeout(timeout):
                return await self._queue.get()
        except TimeoutError:
            return Event(Ev.FAIL, f"no {what} within {timeout:g} s")

    def _tokens(self, tokens: worker_pb2.Tokens, w: WorkerInfo
                ) -> tuple[router_pb2.GenerateResponse, str | None]:
        resp, error = self.out.tokens(tokens, w)
        if error is not None:
            self.ended.add(w.worker_id)
            self._completed = not error
        return resp, error

    def _leg_failed(self, w: WorkerInfo, code: grpc.StatusCode | None, msg: str
                    ) -> router_pb2.GenerateResponse:
        if code == grpc.StatusCode.UNAVAILABLE:
            # Unreachable: stop pairing with it now rather than at the heartbeat timeout;
            # if it is in fact alive, its next heartbeat is refused and it re-registers.
            self._on_unreachable(w, msg)
        return self.out.failed(msg)

    def _stop(self, ev: Event) -> router_pb2.GenerateResponse:
        if ev.kind is Ev.ABORT:
            return self.out.aborted()
        assert ev.kind is Ev.FAIL, ev.kind
        return self.out.failed(str(ev.payload))


def _spawn(coro: Coroutine[Any, Any, None]) -> asyncio.Task[None]:
    return asyncio.get_running_loop().create_task(coro)
