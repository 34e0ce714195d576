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
one when the run is to be placed again.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

import grpc
from pdserve.v1 import common_pb2, router_pb2, worker_pb2

from router.control.registry import WorkerInfo
from router.requests.legs import Ev, Event

if TYPE_CHECKING:
    from router.requests.request_run import RequestRun

FINISH_ERROR = common_pb2.FINISH_REASON_ERROR


async def disaggregated_stream(run: RequestRun) -> AsyncIterator[router_pb2.GenerateResponse]:
    assert run.slot is not None
    p, c = run.slot.producer, run.slot.consumer
    assert p is not None and c is not None
    cfg, out = run.config, run.out
    token0_sent = transferred = consumer_started = False
    held: list[worker_pb2.Tokens] = []  # consumer tokens that overtook token 0

    def recovered(w: WorkerInfo, why: str, code: grpc.StatusCode | None = None) -> bool:
        """Whether a failure of ``w`` sends the request elsewhere (then the stream ends
        without a final message and the run places it again)."""
        if w is p and not token0_sent and not out.completion_tokens:
            # nothing streamed from this placement yet: a plain retry (bounded apart)
            run.note_unreachable(w, code, why)
            return run.retry_after(p, why, held)
        return run.migrate_after(w, why, code)

    while True:
        if not token0_sent:
            ev = await run.next_event(cfg.token0_timeout_s,
                                      f"token 0 from producer {p.worker_id}", p)
        elif not consumer_started:
            # Includes a queued reservation and the KV transfer, hence the long bound.
            ev = await run.next_event(cfg.token0_timeout_s,
                                      f"first token from consumer {c.worker_id}", c)
        else:
            ev = await run.next_event(cfg.token_timeout_s,
                                      f"next token from consumer {c.worker_id}", c)
        if ev.kind is Ev.TOKEN0:
            t0: worker_pb2.Token0 = ev.payload
            resp = out.token0(t0)
            token0_sent = True
            if t0.finish_reason:
                run.completed = True
                yield out.final(resp, t0.finish_reason, t0.stop_reason)
                return
            yield resp
            for tokens in held:
                resp, error = run.tokens(tokens, c)
                yield resp
                if error is not None:
                    return
            held.clear()
        elif ev.kind is Ev.TOKENS:
            tokens = ev.payload
            consumer_started = True
            if not token0_sent:
                held.append(tokens)
                if tokens.finish_reason:
                    run.ended.add(c.worker_id)  # its stream's end is no failure
                continue
            if (tokens.finish_reason == FINISH_ERROR and not tokens.token_ids
                    and recovered(c, f"consumer {c.worker_id}: {tokens.error or 'no details'}")):
                run.ended.add(c.worker_id)  # it ended the request on its side
                return  # e.g. its KV transfer failed after the client got token 0
            resp, error = run.tokens(tokens, c)
            yield resp
            if error is not None:
                return
        elif ev.kind is Ev.TRANSFER:
            tr: worker_pb2.TransferResult = ev.payload
            out.timing.kv_transfer_ms = tr.kv_transfer_ms
            run.ended.add(p.worker_id)  # the producer is done with this request
            if not tr.ok:
                why = (f"KV transfer from producer {p.worker_id} to consumer {c.worker_id} "
                       f"failed: {tr.error or 'no details'}")
                # the producer is alive (it said so): pair again with another consumer
                if not recovered(c, why):
                    yield out.failed(why)
                return
            transferred = True
        elif ev.kind is Ev.PRODUCER_EOF:
            run.ended.add(p.worker_id)
            if not token0_sent:
                why = f"producer {p.worker_id} ended its stream before token 0"
            elif not transferred:
                why = f"producer {p.worker_id} ended its stream without a KV transfer result"
            else:
                continue
            if not recovered(p, why):
                yield out.failed(why)
            return
        elif ev.kind is Ev.DECODE_EOF:
            if c.worker_id in run.ended:
                continue  # finished; its last tokens wait in ``held`` for token 0
            run.ended.add(c.worker_id)
            why = f"consumer {c.worker_id} ended its stream before the request finished"
            if not recovered(c, why):
                yield out.failed(why)
            return
        elif ev.kind is Ev.LEG_ERROR or ev.kind is Ev.TIMEOUT:
            worker, code, msg = _failure(ev)
            if worker.worker_id in run.ended:
                continue  # it did its part (the KV landed / last tokens are held)
            if not recovered(worker, msg, code):
                yield run.leg_failed(worker, code, msg)
            return
        elif ev.kind is Ev.DROPPED:
            worker, why = ev.payload
            if worker.worker_id in run.ended:
                continue  # it had done its part before the registry dropped it
            if not recovered(worker, why):
                yield run.stop(ev)
            return
        else:
            yield run.stop(ev)
            return


async def colocated_stream(run: RequestRun) -> AsyncIterator[router_pb2.GenerateResponse]:
    assert run.slot is not None
    w = run.slot.colocated
    assert w is not None
    started = False
    while True:
        if not started:
            ev = await run.next_event(run.config.token0_timeout_s,
                                      f"token 0 from colocated worker {w.worker_id}", w)
        else:
            ev = await run.next_event(run.config.token_timeout_s,
                                      f"next token from colocated worker {w.worker_id}", w)
        if ev.kind is Ev.TOKENS:
            tokens: worker_pb2.Tokens = ev.payload
            if not started and tokens.token_ids:
                started = True
                if not run.out.completion_tokens:  # a migrated request's first is earlier
                    run.out.timing.router_token0_sent_ns = time.time_ns()
            resp, error = run.tokens(tokens, w)
            yield resp
            if error is not None:
                return
        elif ev.kind is Ev.DECODE_EOF:
            run.ended.add(w.worker_id)
            why = (f"colocated worker {w.worker_id} ended its stream before the request "
                   f"finished")
            if not run.migrate_after(w, why):
                yield run.out.failed(why)
            return
        elif ev.kind is Ev.LEG_ERROR or ev.kind is Ev.TIMEOUT:
            worker, code, msg = _failure(ev)
            if not run.migrate_after(worker, msg, code):
                yield run.leg_failed(worker, code, msg)
            return
        elif ev.kind is Ev.DROPPED and run.migrate_after(*ev.payload):
            return
        else:
            yield run.stop(ev)
            return


def _failure(ev: Event) -> tuple[WorkerInfo, grpc.StatusCode | None, str]:
    """(worker, status code or None, message) of a LEG_ERROR or TIMEOUT event."""
    if ev.kind is Ev.LEG_ERROR:
        return ev.payload  # type: ignore[no-any-return]
    worker, msg = ev.payload
    return worker, None, msg
