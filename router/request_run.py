"""One request in flight: starts its legs, turns their events into client responses.

Disaggregated: the consumer's Decode and the producer's Prefill start together; the
consumer's reservation is forwarded to the producer by the legs themselves; token 0 from
the producer goes to the client the moment it arrives; the consumer's tokens follow.
Colocated: one Decode stream carries tokens 0..n.

Which legs still need ``Worker.Abort`` when the run ends is decided here (``legs_to_abort``)
and carried out by the dispatcher, so that a cancelled client still frees blocks.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable, Coroutine
from enum import Enum, auto
from typing import Any

import grpc
from pdserve.v1 import common_pb2, router_pb2, worker_pb2, worker_pb2_grpc

from router.config import RouterConfig
from router.legs import DecodeLeg, Ev, Event, ProducerLeg
from router.policy import Slot
from router.registry import WorkerInfo
from router.validation import PreparedRequest

log = logging.getLogger(__name__)

FINISH_ERROR = common_pb2.FINISH_REASON_ERROR
FINISH_ABORT = common_pb2.FINISH_REASON_ABORT


class Outcome(Enum):
    RUNNING = auto()  # still streaming, or the client went away mid-stream
    DONE = auto()  # the decoding leg finished the request
    TOKEN0_DONE = auto()  # token 0 ended the request at the producer
    FAILED = auto()  # error or abort


class RequestRun:
    def __init__(self, prep: PreparedRequest, slot: Slot, received_ns: int,
                 stub_for: Callable[[WorkerInfo], worker_pb2_grpc.WorkerStub],
                 config: RouterConfig,
                 on_unreachable: Callable[[WorkerInfo, str], None]) -> None:
        self.prep = prep
        self.slot = slot
        self.config = config
        # Stubs are bound now: a worker dropped mid-request still gets its Abort on the
        # channel this request used.
        self.stubs = {w.worker_id: stub_for(w) for w in slot.workers}
        self._on_unreachable = on_unreachable
        self.queue: asyncio.Queue[Event] = asyncio.Queue()
        self.timing = router_pb2.ServerTiming(router_received_ns=received_ns)
        self.outcome = Outcome.RUNNING
        self.completion_tokens = 0
        self.producer: ProducerLeg | None = None
        self.decode: DecodeLeg | None = None
        self.decode_task: asyncio.Task[None] | None = None
        self.producer_task: asyncio.Task[None] | None = None
        self.ended: set[str] = set()  # worker ids whose leg finished on its own

    @property
    def request_id(self) -> str:
        return self.prep.request_id

    def post(self, event: Event) -> None:
        self.queue.put_nowait(event)

    # -- streaming -------------------------------------------------------------------------

    async def stream(self) -> AsyncIterator[router_pb2.GenerateResponse]:
        gen = self._colocated() if self.slot.colocated is not None else self._disaggregated()
        async for resp in gen:
            yield resp

    async def _disaggregated(self) -> AsyncIterator[router_pb2.GenerateResponse]:
        p, c = self.slot.producer, self.slot.consumer
        assert p is not None and c is not None
        self.timing.producer, self.timing.consumer = p.worker_id, c.worker_id
        cfg, prep = self.config, self.prep
        self.producer = ProducerLeg(p, self.stubs[p.worker_id].Prefill(), self.queue)
        self.decode = DecodeLeg(c, self.stubs[c.worker_id].Decode(self._decode_request(False)),
                                self.queue, self.producer)
        # Decode first: the reservation is the slower path, so it should not start late.
        self.decode_task = _spawn(self.decode.run())
        self.producer_task = _spawn(self.producer.run(worker_pb2.PrefillRequest(
            request_id=prep.request_id, prompt_token_ids=prep.prompt_token_ids,
            sampling=prep.sampling, seed=prep.seed)))
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
                resp = router_pb2.GenerateResponse(request_id=prep.request_id,
                                                   token_ids=[t0.token_id], text=t0.text)
                if t0.HasField("logprob"):
                    resp.logprobs.append(t0.logprob)
                self.completion_tokens += 1
                self.timing.producer_received_ns = t0.received_ns
                self.timing.producer_token0_sampled_ns = t0.sampled_ns
                self.timing.producer_token0_sent_ns = t0.sent_ns
                self.timing.router_token0_sent_ns = time.time_ns()
                token0_sent = True
                if t0.finish_reason:
                    self.outcome = Outcome.TOKEN0_DONE
                    yield self._final(resp, t0.finish_reason, t0.stop_reason)
                    return
                yield resp
                for tokens in held:
                    resp, done = self._tokens(tokens, c)
                    yield resp
                    if done:
                        return
                held.clear()
            elif ev.kind is Ev.TOKENS:
                consumer_started = True
                if not token0_sent:
                    held.append(ev.payload)
                    if ev.payload.finish_reason:
                        self.ended.add(c.worker_id)  # its stream's end is no failure
                    continue
                resp, done = self._tokens(ev.payload, c)
                yield resp
                if done:
                    return
            elif ev.kind is Ev.TRANSFER:
                tr: worker_pb2.TransferResult = ev.payload
                self.timing.kv_transfer_ms = tr.kv_transfer_ms
                self.ended.add(p.worker_id)  # the producer is done with this request
                if not tr.ok:
                    yield self._fail(f"KV transfer from producer {p.worker_id} to consumer "
                                     f"{c.worker_id} failed: {tr.error or 'no details'}")
                    return
                transferred = True
            elif ev.kind is Ev.PRODUCER_EOF:
                self.ended.add(p.worker_id)
                if not token0_sent:
                    yield self._fail(f"producer {p.worker_id} ended its stream before token 0")
                    return
                if not transferred:
                    yield self._fail(f"producer {p.worker_id} ended its stream without a KV "
                                     f"transfer result")
                    return
            elif ev.kind is Ev.DECODE_EOF:
                if c.worker_id in self.ended:
                    continue  # finished; its last tokens wait in ``held`` for token 0
                self.ended.add(c.worker_id)
                yield self._fail(f"consumer {c.worker_id} ended its stream before the request "
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
        w = self.slot.colocated
        assert w is not None
        self.timing.colocated = w.worker_id
        self.decode = DecodeLeg(w, self.stubs[w.worker_id].Decode(self._decode_request(True)),
                                self.queue, None)
        self.decode_task = _spawn(self.decode.run())
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
                    self.timing.router_token0_sent_ns = time.time_ns()
                resp, done = self._tokens(tokens, w)
                yield resp
                if done:
                    return
            elif ev.kind is Ev.DECODE_EOF:
                self.ended.add(w.worker_id)
                yield self._fail(f"colocated worker {w.worker_id} ended its stream before the "
                                 f"request finished")
                return
            elif ev.kind is Ev.LEG_ERROR:
                worker, code, msg = ev.payload
                yield self._leg_failed(worker, code, msg)
                return
            else:
                yield self._stop(ev)
                return

    # -- end of the run --------------------------------------------------------------------

    def legs_to_abort(self) -> list[WorkerInfo]:
        """Workers that may still hold this request and must get Worker.Abort."""
        out = []
        for w in self.slot.workers:
            if w.worker_id in self.ended:
                continue
            if w is self.slot.producer and self.outcome in (Outcome.DONE, Outcome.TOKEN0_DONE):
                continue  # did its part; half-closed, it ends its stream by itself
            out.append(w)
        return out

    # -- helpers ---------------------------------------------------------------------------

    def _decode_request(self, colocated: bool) -> worker_pb2.DecodeRequest:
        prep = self.prep
        return worker_pb2.DecodeRequest(request_id=prep.request_id,
                                        prompt_token_ids=prep.prompt_token_ids,
                                        sampling=prep.sampling, seed=prep.seed,
                                        colocated=colocated)

    async def _next(self, timeout: float, what: str) -> Event:
        try:
            async with asyncio.timeout(timeout):
                return await self.queue.get()
        except TimeoutError:
            return Event(Ev.FAIL, f"no {what} within {timeout:g} s")

    def _tokens(self, tokens: worker_pb2.Tokens, w: WorkerInfo
                ) -> tuple[router_pb2.GenerateResponse, bool]:
        resp = router_pb2.GenerateResponse(request_id=self.prep.request_id,
                                           token_ids=tokens.token_ids, text=tokens.text,
                                           logprobs=tokens.logprobs)
        self.completion_tokens += len(tokens.token_ids)
        if tokens.kv_ready_ns and not self.timing.consumer_kv_ready_ns:
            self.timing.consumer_kv_ready_ns = tokens.kv_ready_ns
        if tokens.first_step_ns and not self.timing.consumer_first_step_ns:
            self.timing.consumer_first_step_ns = tokens.first_step_ns
        if not tokens.finish_reason:
            return resp, False
        self.ended.add(w.worker_id)
        error = ""
        if tokens.finish_reason == FINISH_ERROR:
            error = f"{w.role_name} {w.worker_id}: {tokens.error or 'no details'}"
            log.warning("request %s failed: %s", self.request_id, error)
        self.outcome = Outcome.FAILED if error else Outcome.DONE
        return self._final(resp, tokens.finish_reason, tokens.stop_reason, error), True

    def _leg_failed(self, w: WorkerInfo, code: grpc.StatusCode | None, msg: str
                    ) -> router_pb2.GenerateResponse:
        if code == grpc.StatusCode.UNAVAILABLE:
            # Unreachable: stop pairing with it now rather than at the heartbeat timeout;
            # if it is in fact alive, its next heartbeat is refused and it re-registers.
            self._on_unreachable(w, msg)
        return self._fail(msg)

    def _stop(self, ev: Event) -> router_pb2.GenerateResponse:
        if ev.kind is Ev.ABORT:
            self.outcome = Outcome.FAILED
            return self._final(router_pb2.GenerateResponse(request_id=self.request_id),
                               FINISH_ABORT)
        assert ev.kind is Ev.FAIL, ev.kind
        return self._fail(str(ev.payload))

    def _fail(self, message: str) -> router_pb2.GenerateResponse:
        log.warning("request %s failed: %s", self.request_id, message)
        self.outcome = Outcome.FAILED
        return self._final(router_pb2.GenerateResponse(request_id=self.request_id),
                           FINISH_ERROR, error=message)

    def _final(self, resp: router_pb2.GenerateResponse, finish: int, stop_reason: str = "",
               error: str = "") -> router_pb2.GenerateResponse:
        resp.finish_reason = finish  # type: ignore[assignment]
        resp.stop_reason = stop_reason
        resp.error = error
        resp.usage.prompt_tokens = len(self.prep.prompt_token_ids)
        resp.usage.completion_tokens = self.completion_tokens
        self.timing.router_finished_ns = time.time_ns()
        resp.timing.CopyFrom(self.timing)
        return resp


def _spawn(coro: Coroutine[Any, Any, None]) -> asyncio.Task[None]:
    return asyncio.get_running_loop().create_task(coro)
