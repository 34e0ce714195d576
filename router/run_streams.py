"""How one request's leg events become the client's responses, per kind of slot.

Disaggregated: token 0 comes from the producer and goes out the moment it arrives;
consumer tokens that overtake it are held until it has gone; the producer's transfer
result ends its part; a producer failing before token 0 may send the request to another
producer (``RequestRun.retry_after``). Colocated: one stream carries tokens 0..n.

Each loop reads the run's single event queue (``RequestRun.next_event``), so ordering
questions (token 0 vs. the consumer's tokens, a transfer failure vs. a dead consumer) are
answered in one place; each ends with the request's final message, or returns without
one when the run is to be placed again.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

from pdserve.v1 import router_pb2, worker_pb2

from router.legs import Ev

if TYPE_CHECKING:
    from router.request_run import RequestRun


async def disaggregated_stream(run: RequestRun) -> AsyncIterator[router_pb2.GenerateResponse]:
    assert run.slot is not None
    p, c = run.slot.producer, run.slot.consumer
    assert p is not None and c is not None
    cfg, out = run.config, run.out
    token0_sent = transferred = consumer_started = False
    held: list[worker_pb2.Tokens] = []  # consumer tokens that overtook token 0
    while True:
        if not token0_sent:
            ev = await run.next_event(cfg.token0_timeout_s, f"token 0 from producer {p.worker_id}")
        elif not consumer_started:
            # Includes a queued reservation and the KV transfer, hence the long bound.
            ev = await run.next_event(cfg.token0_timeout_s,
                                      f"first token from consumer {c.worker_id}")
        else:
            ev = await run.next_event(cfg.token_timeout_s,
                                      f"next token from consumer {c.worker_id}")
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
            consumer_started = True
            if not token0_sent:
                held.append(ev.payload)
                if ev.payload.finish_reason:
                    run.ended.add(c.worker_id)  # its stream's end is no failure
                continue
            resp, error = run.tokens(ev.payload, c)
            yield resp
            if error is not None:
                return
        elif ev.kind is Ev.TRANSFER:
            tr: worker_pb2.TransferResult = ev.payload
            out.timing.kv_transfer_ms = tr.kv_transfer_ms
            run.ended.add(p.worker_id)  # the producer is done with this request
            if not tr.ok:
                yield out.failed(f"KV transfer from producer {p.worker_id} to consumer "
                                 f"{c.worker_id} failed: {tr.error or 'no details'}")
                return
            transferred = True
        elif ev.kind is Ev.PRODUCER_EOF:
            run.ended.add(p.worker_id)
            if not token0_sent:
                why = f"producer {p.worker_id} ended its stream before token 0"
                if not run.retry_after(p, why, held):
                    yield out.failed(why)
                return
            if not transferred:
                yield out.failed(f"producer {p.worker_id} ended its stream without a KV "
                                 f"transfer result")
                return
        elif ev.kind is Ev.DECODE_EOF:
            if c.worker_id in run.ended:
                continue  # finished; its last tokens wait in ``held`` for token 0
            run.ended.add(c.worker_id)
            yield out.failed(f"consumer {c.worker_id} ended its stream before the request "
                             f"finished")
            return
        elif ev.kind is Ev.LEG_ERROR:
            worker, code, msg = ev.payload
            if worker.worker_id in run.ended:
                continue  # it did its part (the KV landed / last tokens are held)
            if worker is p and not token0_sent:
                run.note_unreachable(worker, code, msg)
                if run.retry_after(p, msg, held):
                    return
            yield run.leg_failed(worker, code, msg)
            return
        elif ev.kind is Ev.DROPPED and ev.payload[0].worker_id in run.ended:
            continue  # it had done its part before the registry dropped it
        elif (ev.kind is Ev.DROPPED and ev.payload[0] is p and not token0_sent
              and run.retry_after(p, ev.payload[1], held)):
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
                                      f"token 0 from colocated worker {w.worker_id}")
        else:
            ev = await run.next_event(run.config.token_timeout_s,
                                      f"next token from colocated worker {w.worker_id}")
        if ev.kind is Ev.TOKENS:
            tokens: worker_pb2.Tokens = ev.payload
            if not started and tokens.token_ids:
                started = True
                run.out.timing.router_token0_sent_ns = time.time_ns()
            resp, error = run.tokens(tokens, w)
            yield resp
            if error is not None:
                return
        elif ev.kind is Ev.DECODE_EOF:
            run.ended.add(w.worker_id)
            yield run.out.failed(f"colocated worker {w.worker_id} ended its stream before "
                                 f"the request finished")
            return
        elif ev.kind is Ev.LEG_ERROR:
            worker, code, msg = ev.payload
            yield run.leg_failed(worker, code, msg)
            return
        else:
            yield run.stop(ev)
            return
