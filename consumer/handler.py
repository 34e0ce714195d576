"""The consumer role: reserve blocks (queued with backpressure), receive KV and token 0,
admit to decode, stream tokens 1..n with deferred output.

The engine owns every request and its blocks: ``add_remote`` queues it (RESERVING), the
scheduler gives it blocks when the pool and a seat allow (WAITING_FOR_KV, reported by
step()), ``kv_landed`` starts its decode (DECODING), ``abort`` ends it. This handler only
connects that to the receiver: expect() the reserved blocks, and end the request when the
transfer does. Blocks waiting for KV are freed only once the receiver is terminal (no byte
of the transfer will land in them any more).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import replace
from typing import Any

from engine.llm_engine import LLMEngine
from engine.outputs import StepResult
from engine.request import LogprobRow
from engine.request_state import RequestState
from engine.scheduler import QueueFull
from transfer import KVReceiver, TransferConfig, TransferStatus, TransferUpdate, make_receiver
from transfer.tp_receiver import tp_receiver
from worker.load_report import ConsumerLoad, LoadReport, TransferLoad
from worker.messages import (
    AbortCmd,
    Command,
    DecodeCmd,
    ReadyInfo,
    ReservedEvent,
)
from worker.orphans import exhausted_by_orphans
from worker.role import Emit, RoleHandler, error_event, now_ns, tokens_batch
from worker.token_batch import Handoff

log = logging.getLogger("pdserve.consumer")
S = RequestState


class ConsumerHandler(RoleHandler):
    def __init__(self, engine: LLMEngine, emit: Emit, transfer: dict[str, Any],
                 reservation_s: float = 600.0) -> None:
        super().__init__(engine, emit)
        self.cfg = TransferConfig(**transfer)
        # TP: every rank receives its own heads into its own pool shard; under
        # data-parallel attention only the ranks of the group holding the reservation do
        self.receiver: KVReceiver = tp_receiver(
            make_receiver(engine.kv_cache, engine.layout, self.cfg), engine.layout, self.cfg,
            engine.runner.followers, group_of=lambda rid: engine.requests[rid].dp_rank)
        self.source_tp: dict[str, int] = {}  # rid -> the producer's TP size (router's word)
        # reserved, not yet ready (take_ready): rid -> (blocks, leading cached blocks)
        self.unannounced: dict[str, tuple[list[int], int]] = {}
        self.reused: dict[str, int] = {}  # rid -> leading reserved blocks from the cache
        # Timing for the first decode step's metrics, not state: rid -> the handoff's
        # stamps up to the KV landing (admission), then with its first step launched too.
        self.kv_ready: dict[str, Handoff] = {}
        self.first_step: dict[str, Handoff] = {}
        # The receiver's deadline for a reservation: its request may queue behind other
        # prompts on the producer first, so this is not the (short) transfer timeout.
        self.reservation_s = reservation_s
        # A reservation still waiting for KV past its deadline plus peer-loss detection is
        # stuck: the receiver should have ended it by then.
        self.lease_s = reservation_s + self.cfg.peer_timeout_s
        # Cumulative counters for the worker's /metrics (sent with every load report).
        self.kv_bytes_received = 0
        self.transfers_ok = 0
        self.transfers_failed = 0
        self.aborts = 0
        self.queue_full = 0
        self.local_prefills = 0  # requests the router had prefill here (colocated)

    def ready_info(self) -> ReadyInfo:
        return dataclasses.replace(super().ready_info(), kv_address=self.receiver.address)

    def on_command(self, cmd: Command) -> None:
        if isinstance(cmd, DecodeCmd):
            rid = cmd.rid
            if cmd.colocated:  # the router's local prefill: the prompt's tail is short
                self._local(cmd)
                return
            try:
                self.engine.add_remote(rid, list(cmd.prompt_ids),
                                       cmd.sampling, list(cmd.prior_ids),
                                       cmd.cache_salt or None, cmd.reuse_cached,
                                       dp_rank=cmd.dp_rank if cmd.dp_rank >= 0 else None)
            except ValueError as e:
                self.emit(error_event(rid, "error", str(e)))
                return
            except QueueFull:
                self.queue_full += 1
                self.emit(error_event(rid, "error", "consumer reservation queue is full"))
                return
            if cmd.source_tp:
                self.source_tp[rid] = cmd.source_tp
        elif isinstance(cmd, AbortCmd):
            self.aborts += 1
            self.abort(cmd.rid)

    def _local(self, cmd: DecodeCmd) -> None:
        """Prefills here, after whatever this engine's prefix cache holds, and decodes: a
        colocated request (token 0 streams from here too)."""
        try:
            self.engine.add_request(cmd.rid, list(cmd.prompt_ids),
                                    cmd.sampling, list(cmd.prior_ids),
                                    cmd.cache_salt or None,
                                    dp_rank=cmd.dp_rank if cmd.dp_rank >= 0 else None)
        except ValueError as e:
            self.emit(error_event(cmd.rid, "error", str(e)))
            return
        except QueueFull:
            self.queue_full += 1
            self.emit(error_event(cmd.rid, "error", "consumer queue is full"))
            return
        self.local_prefills += 1

    def abort(self, rid: str) -> None:
        state = self.engine.state_of(rid)
        if state == S.RESERVING:
            self.source_tp.pop(rid, None)
            self.engine.abort(rid)
            self.emit(error_event(rid, "abort", "aborted while waiting for KV blocks"))
        elif state == S.WAITING_FOR_KV:
            self.receiver.cancel(rid, "aborted")  # blocks freed once the receiver is terminal
        elif state is not None and self.engine.abort(rid):
            self.kv_ready.pop(rid, None)
            self.first_step.pop(rid, None)
            self.emit(error_event(rid, "abort", "aborted"))

    def _reserved(self, rid: str, blocks: list[int], cached: int) -> None:
        # the cached leading blocks may be shared with running requests: no push may land
        # in them, so the receiver expects only the rest
        self.receiver.expect(rid, blocks[cached:],
                             deadline=time.monotonic() + self.reservation_s,
                             source_tp=self.source_tp.pop(rid, None))
        if cached:
            self.reused[rid] = cached
        self.unannounced[rid] = (blocks, cached)
        self._announce()

    def _announce(self) -> None:
        """Tells the producer where to write, once the receiver is ready for the pushes."""
        for rid in self.receiver.take_ready():
            ann = self.unannounced.pop(rid, None)
            if ann is not None and self.engine.state_of(rid) == S.WAITING_FOR_KV:
                self.emit(ReservedEvent(rid, self.receiver.address_for(rid), tuple(ann[0]),
                                        ann[1]))

    def after_step(self) -> None:
        for u in self.receiver.poll():
            self.receiver.release(u.request_id)
            self.unannounced.pop(u.request_id, None)
            reused = self.reused.pop(u.request_id, 0)
            if self.engine.state_of(u.request_id) != S.WAITING_FOR_KV:
                continue
            if u.status == TransferStatus.DONE and u.notice is not None:
                self.transfers_ok += 1
                held = next(h.blocks for h in self.engine.held_requests()
                            if h.request_id == u.request_id)
                self.kv_bytes_received += (held - reused) * self.engine.layout.block_nbytes
                self._admit(u)
            else:
                self._transfer_failed(u)
        self._announce()

    def _transfer_failed(self, u: TransferUpdate) -> None:
        self.transfers_failed += 1
        rid = u.request_id
        cancelled = u.status == TransferStatus.CANCELLED
        if u.status == TransferStatus.TIMED_OUT:
            log.warning("request %s: reservation deadline passed in WAITING_FOR_KV after "
                        "%.0f s; freeing its blocks", rid, self.reservation_s)
        self.engine.abort(rid, S.FINISHED_ABORTED if cancelled else S.FINISHED_ERROR)
        self.emit(error_event(rid, "abort" if cancelled else "error",
                              f"KV transfer {u.status.name.lower()}: {u.error}"))

    def _admit(self, u: TransferUpdate) -> None:
        assert u.notice is not None
        first_lp = None
        if u.notice.logprobs:  # TransferNotice's shape: (token, lp), *top
            (tok, lp), *top = u.notice.logprobs
            first_lp = LogprobRow(tok, lp, tuple(top))
        try:
            self.engine.kv_landed(u.request_id, u.notice.first_token, first_lp)
        except ValueError as e:
            self.engine.abort(u.request_id, S.FINISHED_ERROR)
            self.emit(error_event(u.request_id, "error", str(e)))
            return
        # the receiver's stamps say where the time to here went: the notice's way over,
        # the copies after it, and the wait for this loop turn's poll
        self.kv_ready[u.request_id] = Handoff(
            u.notice.sent_ns, u.notice_seen_ns, u.kv_done_ns, kv_ready_ns=now_ns())

    def before_step(self, now_ns: int) -> None:
        for rid, ready in self.kv_ready.items():
            self.first_step[rid] = dataclasses.replace(ready, first_step_ns=now_ns)
        self.kv_ready.clear()

    def on_outputs(self, step: StepResult, step_end_ns: int) -> None:
        for rid, blocks in step.reserved.items():
            self._reserved(rid, blocks, step.reserved_cached.get(rid, 0))
        if step.outputs:  # one message for the whole step
            self.emit(tokens_batch(step.outputs, self.first_step))

    def awaiting_kv(self) -> bool:
        return self.engine.num_in(S.WAITING_FOR_KV) > 0

    def has_background_work(self) -> bool:
        return self.engine.num_in(S.RESERVING, S.WAITING_FOR_KV) > 0

    def load(self) -> LoadReport:
        base = super().load()
        orphans = sum(h.blocks for h in self.engine.held_requests()
                      if h.state == S.WAITING_FOR_KV and h.state_age_s > self.lease_s)
        kv = self.receiver.stats()  # its KV port: what strangers and broken peers sent
        return replace(
            base, waiting=base.waiting + self.engine.num_in(S.RESERVING),
            transfers_in_flight=self.engine.num_in(S.WAITING_FOR_KV),
            kv_exhausted_by_orphans=exhausted_by_orphans(base.kv_blocks_free,
                                                         base.kv_blocks_total, orphans),
            transfer=TransferLoad(orphan_blocks=orphans, transfers_ok=self.transfers_ok,
                                  transfers_failed=self.transfers_failed, aborts=self.aborts,
                                  kv_malformed_messages=kv.malformed_messages,
                                  kv_rejected_handshakes=kv.rejected_handshakes),
            # Preempting an admitted request drops the KV it received: the engine recomputes
            # the whole prompt locally, the silent degradation the transfer exists to avoid.
            consumer=ConsumerLoad(recomputed=self.engine.num_preemptions,
                                  kv_bytes_received=self.kv_bytes_received,
                                  reservation_queue_full=self.queue_full,
                                  local_prefills=self.local_prefills))

    def close(self) -> None:
        self.receiver.close()
