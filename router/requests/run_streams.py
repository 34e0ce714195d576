"""How one request's leg events become the client's responses, per kind of slot.

Disaggregated: token 0 comes from the producer and goes out the moment it arrives;
consumer tokens that overtake it are held until it has gone; the producer's transfer
result ends its part; a producer failing before token 0 may send the request to another
producer (``RequestRun.retry_after``), any other worker failure may migrate it with the
tokens already streamed (``RequestRun.migrate_after``). Colocated: one stream carries
tokens 0..n, and a failure of its worker may migrate it too.

Each loop reads the run's single event queue (``RequestRun.next_event``), so ordering
questions (token 0 vs. the consumer's tokens, a transfer failure vs. a dead consumer) are
answered in one place; each ends with the request's final message, or returns without
one when the run is to be placed again. The loops move the run's phase
(router/requests/run_phase.py) as they hand reports on, and read what they need to know
(has token 0 gone out, has the consumer started) from it.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Protocol

import grpc
from pdserve.v1 import common_pb2, router_pb2, worker_pb2

from router.config import RouterConfig
from router.control.policy import Slot
from router.control.registry import WorkerInfo
from router.requests.errors import Overloaded
from router.requests.run_events import (
    DecodeEnded,
    Dropped,
    Event,
    LegFailed,
    ProducerEnded,
    Reserved,
    TimedOut,
    Token0Read,
    Token0Written,
    TokensRead,
    TransferRead,
)
from router.requests.run_output import RunOutput
from router.requests.run_phase import RunPhase


class StreamedRun(Protocol):
    """What the loops need of a request's run (``RequestRun``)."""

    config: RouterConfig
    out: RunOutput
    slot: Slot | None
    phase: RunPhase
    ended: set[str]  # worker ids whose leg finished its part

    def advance(self, phase: RunPhase) -> None: ...

    async def next_event(self, timeout: float, what: str, waiting_on: WorkerInfo,
                         bound: float | None = None) -> Event: ...

    def tokens(self, tokens: worker_pb2.Tokens, w: WorkerInfo
               ) -> tuple[router_pb2.GenerateResponse, str | None]: ...

    def retry_after(self, p: WorkerInfo, why: str, held: list[worker_pb2.Tokens],
                    busy: bool = False) -> bool: ...

    def migrate_after(self, w: WorkerInfo, why: str, code: grpc.StatusCode | None = None
                      ) -> bool: ...

    def note_unreachable(self, w: WorkerInfo, code: grpc.StatusCode | None, msg: str
                         ) -> None: ...

    def leg_failed(self, w: WorkerInfo, code: grpc.StatusCode | None, msg: str
                   ) -> router_pb2.GenerateResponse: ...

    def stop(self, ev: Event) -> router_pb2.GenerateResponse: ...


FINISH_ERROR = common_pb2.FINISH_REASON_ERROR
DECODING = RunPhase.DECODING


async def disaggregated_stream(run: StreamedRun
                               ) -> AsyncIterator[router_pb2.GenerateResponse]:
    assert run.slot is not None
    p, c = run.slot.producer, run.slot.consumer
    assert p is not None and c is not None
    cfg, out = run.config, run.out
    held: list[worker_pb2.Tokens] = []  # consumer tokens that overtook token 0
    # the consumer's reservation comes through the queue too: token 0's bound is kept
    token0_by = time.monotonic() + cfg.token0_timeout_s

    def token0_sent() -> bool:
        return run.phase >= RunPhase.TOKEN0

    def recovered(w: WorkerInfo, why: str, code: grpc.StatusCode | None = None) -> bool:
        """Whether a failure of ``w`` sends the request elsewhere (then the stream ends
        without a final message and the run places it again)."""
        if w is p and not token0_sent() and not out.completion_tokens:
            # nothing streamed from this placement yet: a plain retry (bounded apart)
            run.note_unreachable(w, code, why)
            return run.retry_after(p, why, held)
        return run.migrate_after(w, why, code)

    next_token = f"next token from consumer {c.worker_id}"
    while True:
        if run.phase is DECODING:
            ev = await run.next_event(cfg.token_timeout_s, next_token, c)
            if type(ev) is TokensRead and not ev.tokens.finish_reason:
                # the steady state, once per message: more tokens of a decoding request
                yield run.tokens(ev.tokens, c)[0]
                continue
        elif not token0_sent():
            ev = await run.next_event(max(0.0, token0_by - time.monotonic()),
                                      f"token 0 from producer {p.worker_id}", p,
                                      cfg.token0_timeout_s)
        else:
            # Includes a queued reservation and the KV transfer, hence the long bound.
            ev = await run.next_event(cfg.token0_timeout_s,
                                      f"first token from consumer {c.worker_id}", c)
        match ev:
            case Reserved():
                run.advance(RunPhase.PAIRED)  # the run sent the blocks on to the producer
            case Token0Read() | Token0Written():
                if isinstance(ev, Token0Read):  # else it went out from the producer's batch
                    t0 = ev.token0
                    resp = out.token0(t0, ev.read_ns)
                    run.advance(RunPhase.TOKEN0)
                    if t0.finish_reason:
                        yield out.final(resp, t0.finish_reason, t0.stop_reason)
                        return
                    yield resp
                if held:
                    run.advance(RunPhase.DECODING)
                for tokens in held:
                    resp, error = run.tokens(tokens, c)
                    yield resp
                    if error is not None:
                        return
                held.clear()
            case TokensRead(tokens=tokens):
                if not token0_sent():
                    held.append(tokens)
                    if tokens.finish_reason:
                        run.ended.add(c.worker_id)  # its stream's end is no failure
                    continue
                if (tokens.finish_reason == FINISH_ERROR and not tokens.token_ids
                        and recovered(c, f"consumer {c.worker_id}: "
                                         f"{tokens.error or 'no details'}")):
                    run.ended.add(c.worker_id)  # it ended the request on its side
                    return  # e.g. its KV transfer failed after the client got token 0
                run.advance(RunPhase.DECODING)
                resp, error = run.tokens(tokens, c)
                yield resp
                if error is not None:
                    return
            case TransferRead(result=tr):
                out.timing.kv_transfer_ms = tr.kv_transfer_ms
                run.ended.add(p.worker_id)  # the producer is done with this request
                if tr.busy and not tr.ok and not token0_sent():
                    # refused before its prefill: another producer, else a clean refusal
                    # (RESOURCE_EXHAUSTED before any response) unless the client has tokens
                    why = f"producer {p.worker_id}: {tr.error or 'busy'}"
                    if run.retry_after(p, why, held, busy=True):
                        return
                    if out.completion_tokens:  # a migrated request: its client has tokens
                        yield out.failed(why)
                        return
                    raise Overloaded(f"{why}; retry later", cfg.retry_after_s)
                if not tr.ok:
                    why = (f"KV transfer from producer {p.worker_id} to consumer "
                           f"{c.worker_id} failed: {tr.error or 'no details'}")
                    # the producer is alive (it said so): pair again with another consumer
                    if not recovered(c, why):
                        yield out.failed(why)
                    return
                run.advance(RunPhase.KV_LANDED)
            case ProducerEnded():
                transferred = p.worker_id in run.ended  # an ok transfer result ended it
                run.ended.add(p.worker_id)
                if not token0_sent():
                    why = f"producer {p.worker_id} ended its stream before token 0"
                elif not transferred:
                    why = (f"producer {p.worker_id} ended its stream without a KV transfer "
                           "result")
                else:
                    continue
                if not recovered(p, why):
                    yield out.failed(why)
                return
            case DecodeEnded():
                if c.worker_id in run.ended:
                    continue  # finished; its last tokens wait in ``held`` for token 0
                run.ended.add(c.worker_id)
                why = f"consumer {c.worker_id} ended its stream before the request finished"
                if not recovered(c, why):
                    yield out.failed(why)
                return
            case LegFailed() | TimedOut():
                worker, code, msg = _failure(ev)
                if worker.worker_id in run.ended:
                    continue  # it did its part (the KV landed / last tokens are held)
                if not recovered(worker, msg, code):
                    yield run.leg_failed(worker, code, msg)
                return
            case Dropped(worker=worker, reason=why):
                if worker.worker_id in run.ended:
                    continue  # it had done its part before the registry dropped it
                if not recovered(worker, why):
                    yield run.stop(ev)
                return
            case _:
                yield run.stop(ev)
                return


async def colocated_stream(run: StreamedRun) -> AsyncIterator[router_pb2.GenerateResponse]:
    assert run.slot is not None
    w = run.slot.colocated
    assert w is not None
    next_token = f"next token from colocated worker {w.worker_id}"
    while True:
        if run.phase is DECODING:
            ev = await run.next_event(run.config.token_timeout_s, next_token, w)
            if type(ev) is TokensRead and not ev.tokens.finish_reason:
                yield run.tokens(ev.tokens, w)[0]  # the steady state (see above)
                continue
        else:
            ev = await run.next_event(run.config.token0_timeout_s,
                                      f"token 0 from colocated worker {w.worker_id}", w)
        match ev:
            case TokensRead(tokens=tokens):
                if run.phase is not RunPhase.DECODING and tokens.token_ids:
                    run.advance(RunPhase.DECODING)
                    if not run.out.completion_tokens:  # a migrated request's first is earlier
                        run.out.timing.router_token0_sent_ns = time.time_ns()
                resp, error = run.tokens(tokens, w)
                yield resp
                if error is not None:
                    return
            case DecodeEnded():
                run.ended.add(w.worker_id)
                why = (f"colocated worker {w.worker_id} ended its stream before the request "
                       f"finished")
                if not run.migrate_after(w, why):
                    yield run.out.failed(why)
                return
            case LegFailed() | TimedOut():
                worker, code, msg = _failure(ev)
                if not run.migrate_after(worker, msg, code):
                    yield run.leg_failed(worker, code, msg)
                return
            case Dropped(worker=worker, reason=why) if run.migrate_after(worker, why):
                return
            case _:
                yield run.stop(ev)
                return


def _failure(ev: LegFailed | TimedOut) -> tuple[WorkerInfo, grpc.StatusCode | None, str]:
    """(worker, status code or None, message) of a failed leg or a timeout."""
    if isinstance(ev, LegFailed):
        return ev.worker, ev.code, ev.message
    return ev.worker, None, ev.message
