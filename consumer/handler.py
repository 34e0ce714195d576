"""The consumer role: reserve blocks (queued with backpressure), receive KV and token 0,
admit to decode, stream tokens 1..n with deferred output.

Resource owners: a reservation's blocks belong to this handler from reserve() until the
transfer is DONE (then the engine's request owns them) or fails/aborts (then freed here).
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from engine.llm_engine import LLMEngine
from engine.outputs import RequestOutput
from engine.request import LogprobRow
from engine.sampling_params import SamplingParams
from transfer import TransferConfig, TransferStatus, make_receiver
from worker.messages import AbortCmd, Command, DecodeCmd, ReservedEvent
from worker.orphans import exhausted_by_orphans
from worker.role import Emit, RoleHandler, error_event, now_ns, sampling_from_wire, tokens_event

log = logging.getLogger("pdserve.consumer")


@dataclass
class Pending:
    """A request between Decode and admission to the engine."""

    rid: str
    prompt: list[int]
    params: SamplingParams
    blocks: list[int] = field(default_factory=list)  # empty while queued for blocks
    queued_at: float = field(default_factory=time.monotonic)
    reserved_at: float = 0.0  # monotonic; when the blocks were reserved
    prior: list[int] = field(default_factory=list)  # a migrated request's streamed tokens


class ConsumerHandler(RoleHandler):
    def __init__(self, engine: LLMEngine, emit: Emit, transfer: dict[str, Any],
                 reservation_s: float = 600.0) -> None:
        super().__init__(engine, emit)
        self.cfg = TransferConfig(**transfer)
        self.receiver = make_receiver(engine.kv_cache, engine.layout, self.cfg)
        self.queue: OrderedDict[str, Pending] = OrderedDict()  # waiting for blocks
        self.expecting: dict[str, Pending] = {}  # blocks reserved, KV not landed
        self.kv_ready: dict[str, int] = {}  # admitted, first decode step not launched yet
        self.first_step: dict[str, tuple[int, int]] = {}  # rid -> (kv_ready, first step) ns
        self.max_queue = engine.config.max_waiting
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

    def ready_info(self) -> dict[str, Any]:
        return {**super().ready_info(), "kv_address": self.receiver.address}

    def on_command(self, cmd: Command) -> None:
        if isinstance(cmd, DecodeCmd):
            rid = cmd.rid
            try:
                params = sampling_from_wire(cmd.sampling)
                self.engine.validate(list(cmd.prompt_ids), params)
                if cmd.prior_ids:
                    self.engine.validate_prior(list(cmd.prompt_ids), params, list(cmd.prior_ids))
            except ValueError as e:
                self.emit(error_event(rid, "error", str(e)))
                return
            if len(self.queue) >= self.max_queue:
                self.queue_full += 1
                self.emit(error_event(rid, "error", "consumer reservation queue is full"))
                return
            self.queue[rid] = Pending(rid, list(cmd.prompt_ids), params,
                                      prior=list(cmd.prior_ids))
            self._reserve_queued()
        elif isinstance(cmd, AbortCmd):
            self.aborts += 1
            self.abort(cmd.rid)

    def abort(self, rid: str) -> None:
        if self.queue.pop(rid, None) is not None:
            self.emit(error_event(rid, "abort", "aborted while waiting for KV blocks"))
        elif rid in self.expecting:
            self.receiver.cancel(rid, "aborted")  # blocks freed once the receiver is terminal
        elif self.engine.abort(rid):
            self.kv_ready.pop(rid, None)
            self.first_step.pop(rid, None)
            self.emit(error_event(rid, "abort", "aborted"))

    def _reserve_queued(self) -> None:
        # FIFO: a big reservation at the head waits rather than being overtaken forever.
        while self.queue:
            p = next(iter(self.queue.values()))
            blocks = self.engine.reserve(len(p.prompt) + len(p.prior))
            if blocks is None:
                return
            del self.queue[p.rid]
            p.blocks = blocks
            p.reserved_at = time.monotonic()
            self.expecting[p.rid] = p
            self.receiver.expect(p.rid, blocks,
                                 deadline=time.monotonic() + self.reservation_s)
            self.emit(ReservedEvent(p.rid, self.receiver.address, tuple(blocks)))

    def after_step(self) -> None:
        for u in self.receiver.poll():
            p = self.expecting.pop(u.request_id, None)
            self.receiver.release(u.request_id)
            if p is None:
                continue
            if u.status == TransferStatus.DONE and u.notice is not None:
                self.transfers_ok += 1
                self.kv_bytes_received += len(p.blocks) * self.engine.layout.block_nbytes
                self._admit(p, u.notice.first_token, u.notice.logprobs)
            else:
                self.transfers_failed += 1
                self.engine.unreserve(p.blocks)
                finish = "abort" if u.status == TransferStatus.CANCELLED else "error"
                self.emit(error_event(p.rid, finish, f"KV transfer {u.status.name.lower()}: "
                                                     f"{u.error}"))
        self._reserve_queued()

    def _admit(self, p: Pending, first_token: int,
               logprobs: tuple[tuple[int, float], ...] | None) -> None:
        first_lp = None
        if logprobs:  # the notice's shape (transfer's, this round): (token, logprob), *top
            (tok, lp), *top = logprobs
            first_lp = LogprobRow(tok, lp, tuple(top))
        try:
            self.engine.add_prefilled(p.rid, p.prompt, p.params, p.blocks, first_token,
                                      first_lp, prior_output_ids=p.prior)
        except ValueError as e:
            self.engine.unreserve(p.blocks)
            self.emit(error_event(p.rid, "error", str(e)))
            return
        self.kv_ready[p.rid] = now_ns()

    def before_step(self, now_ns: int) -> None:
        for rid, ready in self.kv_ready.items():
            self.first_step[rid] = (ready, now_ns)
        self.kv_ready.clear()

    def on_outputs(self, outs: list[RequestOutput], step_end_ns: int) -> None:
        for out in outs:
            times = self.first_step.pop(out.request_id, (0, 0))
            self.emit(tokens_event(out, kv_ready_ns=times[0], first_step_ns=times[1]))

    def has_background_work(self) -> bool:
        return bool(self.expecting or self.queue)

    def load(self) -> dict[str, Any]:
        d = super().load()
        d["waiting"] += len(self.queue)
        d["transfers_in_flight"] = len(self.expecting)
        now = time.monotonic()
        orphans = sum(len(p.blocks) for p in self.expecting.values()
                      if now - p.reserved_at > self.lease_s)
        d["kv_exhausted_by_orphans"] = exhausted_by_orphans(d["kv_blocks_free"],
                                                            d["kv_blocks_total"], orphans)
        # Preempting an admitted request drops the KV it received: the engine recomputes
        # the whole prompt locally, the silent degradation the transfer exists to avoid.
        d.update(orphan_blocks=orphans, recomputed=self.engine.num_preemptions,
                 kv_bytes_received=self.kv_bytes_received, transfers_ok=self.transfers_ok,
                 transfers_failed=self.transfers_failed, aborts=self.aborts,
                 reservation_queue_full=self.queue_full)
        kv = self.receiver.stats()  # its KV port: what strangers and broken peers sent
        d.update(kv_malformed_messages=kv.malformed_messages,
                 kv_rejected_handshakes=kv.rejected_handshakes)
        return d

    def close(self) -> None:
        self.receiver.close()
