"""The producer role: chunked prefill in direct-output mode; token 0 leaves in the step that
sampled it; each chunk's newly filled blocks are pushed to the consumer's reservation while
later chunks compute; blocks are held under a lease until the consumer acks.

Resource owner: the engine request owns its blocks from admission until release(). Each
push first pins the blocks it sends (``LLMEngine.pin``), so neither a preemption nor an abort
returns them to the pool while the sender may still read them; release() here, once the
transfer is terminal (DONE, failed, cancelled), frees them. A request never pushed is
simply aborted. The request's state is the engine's (``state_of``): QUEUED, PREFILLING,
TRANSFERRING once token 0 is out, FINISHED_* when token 0 ended it or it was failed. The
transfer's own progress (destination, pushes, the final notice, the ack) is
``Outgoing.phase``, a checked ``TransferPhase`` (producer/transfer_phase.py opens with its
lifecycle).

Leases: until the destination comes, the lease is renewed by the router's ``HoldCmd``,
sent while the consumer is alive and its reservation waits for blocks (backpressure slows
the cluster; it does not fail requests); when the consumer dies or the router goes quiet the
renewals stop and the blocks are freed ``lease_s`` later at most (plus one engine step).
The destination renews it too; after it, the lease bounds the pushes and the consumer's ack.

A lease is judged at the moment this process last *listened* to the router, not at the
moment the check runs: the engine loop applies commands only between steps, so a hold or a
destination that arrived during a step longer than the lease (a long prefill chunk, a CPU
under load) is still queued when ``after_step`` runs. Judged at "now", such a request was
failed with "no destination" while its renewal sat in the queue.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field, replace
from typing import Any

from engine.llm_engine import LLMEngine
from engine.outputs import RequestOutput, StepResult
from engine.request import LogprobRow
from engine.request_state import RequestState
from engine.scheduler import QueueFull
from producer.transfer_phase import TransferPhase, check_transfer
from transfer import TransferConfig, TransferError, TransferNotice, TransferStatus, make_sender
from transfer.tp_sender import tp_sender
from worker.load_report import LoadReport, ProducerLoad, TransferLoad
from worker.messages import (
    AbortCmd,
    Command,
    DestinationCmd,
    HoldCmd,
    PrefillCmd,
    Token0Event,
    Token0SentCmd,
    TransferResultEvent,
)
from worker.orphans import exhausted_by_orphans
from worker.role import Emit, RoleHandler, now_ns, stop_text

log = logging.getLogger("pdserve.producer")
# How long the engine loop holds the next step for a Token0SentCmd (see command_wait_ms):
# a few round trips between the two processes, a small share of any prefill step.
TOKEN0_SENT_WAIT_S = 0.02


@dataclass
class Outgoing:
    rid: str
    received_ns: int
    lease_until: float  # monotonic: the destination (and later the ack) must come by then
    phase: TransferPhase = TransferPhase.AWAITING_DEST  # moved only by move()
    dest_address: str = ""
    dest_blocks: list[int] = field(default_factory=list)  # set with the destination
    final: int = 0  # leading blocks whose KV is final (the engine's last step report)
    pushed: int = 0  # leading blocks pushed (and pinned) so far
    notice: TransferNotice | None = None  # built with token 0; sent in RELEASED
    token0_at: float = 0.0  # monotonic: when token 0 went to the gRPC process
    first_push: float = 0.0  # monotonic, for kv_transfer_ms
    num_prior: int = 0  # a migrated request's prior outputs: their KV goes with the prompt's
    # Leading destination blocks the consumer's prefix cache holds already: never sent
    # (pushes start after them; the consumer's receiver refuses writes into them).
    skip: int = 0

    @property
    def started(self) -> bool:
        """Some blocks were pushed (and pinned): the sender owns the transfer's end."""
        return self.pushed > self.skip

    def move(self, new: TransferPhase) -> None:
        check_transfer(self.phase, new)
        self.phase = new


class ProducerHandler(RoleHandler):
    def __init__(self, engine: LLMEngine, emit: Emit, transfer: dict[str, Any],
                 lease_s: float) -> None:
        super().__init__(engine, emit)
        self.cfg = TransferConfig(**transfer)
        # every rank pushes its own heads (a TP engine's followers get their own senders);
        # under data-parallel attention only the ranks of the request's group do
        self.sender = tp_sender(make_sender(engine.kv_cache, engine.layout, self.cfg),
                                engine.layout, self.cfg, engine.runner.followers,
                                group_of=lambda rid: engine.requests[rid].dp_rank)
        self.lease_s = lease_s
        self.out: dict[str, Outgoing] = {}
        # monotonic: when the loop last applied the queued commands before a step (0: no
        # step this turn, so it did just before after_step); what leases are judged at
        self._listened_at = 0.0
        self._judged_at = 0.0  # the time the last after_step judged leases at
        # The last step's StepResult.kv_written: every block counted final so far is written
        # once it has, and a push made during the next step waits for it alone.
        self._kv_written: object | None = None
        self.lease_expiries = 0
        # Cumulative counters for the worker's /metrics (sent with every load report).
        self.kv_bytes_sent = 0
        self.transfers_ok = 0
        self.transfers_failed = 0
        self.aborts = 0
        # The token 0s sent from the engine's read-back (_send_token0s), for on_outputs to
        # go on with; None: this step's went nowhere yet (on_outputs sends them)
        self._sent: list[tuple[Outgoing, RequestOutput, LogprobRow | None]] | None = None
        engine.on_read = self._send_token0s

    # ---- commands ----------------------------------------------------------------------

    def on_command(self, cmd: Command) -> None:
        if isinstance(cmd, PrefillCmd):
            rid = cmd.rid
            try:
                self.engine.add_request(rid, list(cmd.prompt_ids),
                                        cmd.sampling, list(cmd.prior_ids),
                                        cmd.cache_salt or None,
                                        dp_rank=cmd.dp_rank if cmd.dp_rank >= 0 else None)
            except ValueError as e:
                self._transfer_event(rid, False, str(e))
                return
            except QueueFull as e:  # busy, not broken: the router may go elsewhere
                self._transfer_event(rid, False, f"producer busy: {e}", busy=True)
                return
            self.out[rid] = Outgoing(rid, cmd.received_ns, time.monotonic() + self.lease_s,
                                     num_prior=len(cmd.prior_ids))
        elif isinstance(cmd, DestinationCmd):
            o = self.out.get(cmd.rid)
            if o is None or not o.phase.awaits_dest or self._ended(o):
                return
            if not 0 <= cmd.cached_blocks < len(cmd.block_ids):
                # at least the block holding the last prompt token always moves (the
                # consumer's reservation never reuses it), and the final notice rides on it
                self._fail(o, f"cached_blocks: {cmd.cached_blocks} of {len(cmd.block_ids)} "
                              "destination blocks; must leave at least one to send")
                return
            try:
                self.sender.connect(cmd.kv_address)
            except TransferError as e:
                self._fail(o, f"cannot reach consumer {cmd.consumer_id} at {cmd.kv_address}: "
                              f"{e}")
                return
            o.dest_address, o.dest_blocks = cmd.kv_address, list(cmd.block_ids)
            o.skip = o.pushed = cmd.cached_blocks
            o.move(o.phase.with_dest())
            o.lease_until = max(o.lease_until, time.monotonic() + self.lease_s)
            self._push_ready(o)
        elif isinstance(cmd, HoldCmd):
            o = self.out.get(cmd.rid)
            if o is not None and o.phase.awaits_dest:
                o.lease_until = max(o.lease_until, time.monotonic() + self.lease_s)
        elif isinstance(cmd, Token0SentCmd):
            o = self.out.get(cmd.rid)
            if o is not None and (new := o.phase.with_token0_sent()) is not None:
                o.move(new)
                self._push_ready(o)
        elif isinstance(cmd, AbortCmd):
            o = self.out.get(cmd.rid)
            if o is not None:
                self.aborts += 1
                self._fail(o, "aborted by the router", RequestState.FINISHED_ABORTED)

    # ---- engine outputs -----------------------------------------------------------------

    def _send_token0s(self, outputs: list[RequestOutput]) -> None:
        """Emits and sends a step's token 0s at once (the engine's ``on_read``, called
        right after the step's read-back): the client's first token must not wait for the
        step's result, its KV pushes or the rest of the loop turn (the first-token hold)."""
        sampled = []
        for out in outputs:
            o = self.out.get(out.request_id)
            if o is None or not out.new_token_ids:
                continue
            row = out.new_logprobs[0] if out.new_logprobs else None
            self.emit(Token0Event(o.rid, out.new_token_ids[0], out.new_text, row,
                                  out.finish_reason, stop_text(out.stop_reason),
                                  out.sampled_ns, o.received_ns, out.num_cached_tokens,
                                  time.time_ns()))
            sampled.append((o, out, row))
        if sampled:
            self.flush_events()
        self._sent = sampled

    def on_outputs(self, step: StepResult, step_end_ns: int) -> None:
        self._kv_written = step.kv_written
        for rid, n in step.final_blocks.items():
            if (o := self.out.get(rid)) is not None:
                o.final = n
        if self._sent is None:  # the hook did not run: a step without outputs, or a
            # producer made to defer (defer_output, for benchmarks), read a step late
            self._send_token0s(step.outputs)
        sampled, self._sent = self._sent or [], None
        for o, out, row in sampled:
            tok = out.new_token_ids[0]
            if out.finished:  # token 0 ended it: the engine freed all but the pinned blocks
                if o.started:  # close the early chunks' transfer now, not at its deadline;
                    o.move(TransferPhase.CANCELLING)  # the pins go with the sender's report
                    self.sender.cancel(o.rid, "token 0 finished the request")
                else:
                    self._drop(o)
                continue
            # TransferNotice carries logprobs in its own wire shape, ((token, logprob), *top);
            # the consumer converts it back to a LogprobRow.
            o.notice = TransferNotice(
                request_id=o.rid, first_token=tok, finished=False,
                num_prompt_tokens=out.num_prompt_tokens + o.num_prior, seed=out.seed,
                logprobs=((tok, row.logprob), *row.top) if row is not None else None)
            o.move(o.phase.with_token0())
            o.lease_until = time.monotonic() + self.lease_s
            o.token0_at = time.monotonic()
            self._push_ready(o)

    def takes_during_step(self, cmd: Command) -> bool:
        """A destination, a hold or a token-0 confirmation only moves a transfer on (pushes
        blocks final before the step, sends a notice): none touches the step's requests."""
        return isinstance(cmd, DestinationCmd | HoldCmd | Token0SentCmd)

    def command_wait_ms(self) -> int:
        """The final notice of a request whose blocks are all pushed waits only for its
        Token0SentCmd, a round trip through the gRPC process (about a millisecond). Waiting
        for it here, up to TOKEN0_SENT_WAIT_S, lets the notice leave before the next step
        rather than after it: otherwise the consumer starts a whole prefill step late
        whenever other prompts are queued behind this one."""
        now, wait = time.monotonic(), 0.0
        for o in self.out.values():
            if (o.phase is TransferPhase.TOKEN0_HELD
                    and o.pushed >= min(o.final, len(o.dest_blocks))):
                wait = max(wait, o.token0_at + TOKEN0_SENT_WAIT_S - now)
        return math.ceil(wait * 1e3) if wait > 0 else 0

    def _ended(self, o: Outgoing) -> bool:
        state = self.engine.state_of(o.rid)
        return state is None or state.finished

    def _push_ready(self, o: Outgoing) -> None:
        """Pushes the blocks filled since the last push; once RELEASED, all and the end."""
        if not o.phase.has_dest or self._ended(o):
            return
        upto = min(o.final, len(o.dest_blocks))
        try:
            if upto > o.pushed:
                if not o.first_push:
                    o.first_push = time.monotonic()
                src = self.engine.pin(o.rid, o.pushed, upto)
                self.sender.push(o.rid, o.dest_address, src, o.dest_blocks[o.pushed:upto],
                                 # set by the first push and not moved: it must also
                                 # cover the chunks still to compute and a late ack
                                 deadline=time.monotonic() + self.lease_s
                                 + self.cfg.transfer_timeout_s, after=self._kv_written)
                self.kv_bytes_sent += (upto - o.pushed) * self.engine.layout.block_nbytes
                o.pushed = upto
            if o.phase is TransferPhase.RELEASED:
                assert o.notice is not None  # built with token 0
                # stamped as it is handed over (a network sender stamps it again as it
                # goes on the wire): the consumer splits the handoff from there (the
                # wire and its read, its copies, its engine loop's poll)
                self.sender.finish(o.rid, replace(o.notice, sent_ns=now_ns()))
                o.move(TransferPhase.NOTIFIED)  # DONE comes with the consumer's ack
                o.lease_until = time.monotonic() + self.cfg.transfer_timeout_s
        except TransferError as e:
            self._fail(o, str(e))

    # ---- transfers and leases -----------------------------------------------------------

    def before_step(self, now_ns: int) -> None:
        # WorkerLoop.turn: drain the commands, before_step, step, on_outputs, after_step;
        # whatever the router sends from here on waits for the next turn's drain.
        self._listened_at = time.monotonic()

    def after_step(self) -> None:
        for o in list(self.out.values()):
            self._push_ready(o)  # pushes only what the last step filled; cheap otherwise
        for u in self.sender.poll():
            self.sender.release(u.request_id)
            rec = self.out.get(u.request_id)
            if rec is None:
                continue
            self._drop(rec)
            state = self.engine.state_of(rec.rid)
            self.engine.release(rec.rid)  # the sender reads none of its blocks any more
            if state in (RequestState.FINISHED_STOPPED, RequestState.FINISHED_LENGTH):
                continue  # token 0 ended it and said so; the early chunks' transfer is moot
            if u.status == TransferStatus.DONE:
                self.transfers_ok += 1
                ms = (time.monotonic() - rec.first_push) * 1e3 if rec.first_push else 0.0
                self._transfer_event(rec.rid, True, "", ms)
            else:
                self.transfers_failed += 1
                if u.status == TransferStatus.TIMED_OUT:
                    log.warning("request %s: transfer deadline passed in %s; freeing its "
                                "blocks", rec.rid, state.name if state else "?")
                self._transfer_event(rec.rid, False, f"KV transfer {u.status.name.lower()}: "
                                                   f"{u.error}")
        # Judged as of the last drain of the command queue: a hold, a destination or a
        # Token0SentCmd (which the final notice waits for) that came during the step counts.
        # (The ack is polled just above, but judging it one step late costs nothing.)
        listened = self._listened_at or time.monotonic()
        self._listened_at = 0.0
        self._judged_at = listened
        for o in list(self.out.values()):
            if (listened > o.lease_until
                    and self.engine.state_of(o.rid) == RequestState.TRANSFERRING):
                self._expire(o, "no destination and no hold from the router: the consumer's "
                                "reservation never reached this producer"
                             if o.phase.awaits_dest else
                             "no acknowledgement from the consumer")

    def _expire(self, o: Outgoing, why: str) -> None:
        self.lease_expiries += 1
        log.warning("request %s: lease expired in TRANSFERRING after %g s, %s; freeing its "
                    "blocks", o.rid, self.lease_s, why)
        self._fail(o, f"lease expired after {self.lease_s:g} s: {why}")

    def _fail(self, o: Outgoing, error: str,
              state: RequestState = RequestState.FINISHED_ERROR) -> None:
        """Ends o (abort, failure, lease expiry): the engine frees its blocks now, except
        those pinned by pushes, which the sender's terminal report releases."""
        if self._ended(o):
            return
        self.engine.abort(o.rid, state)
        if o.started:
            o.move(TransferPhase.CANCELLING)
            self.sender.cancel(o.rid, error)
            return
        self.engine.release(o.rid)
        self._drop(o)
        self._transfer_event(o.rid, False, error)

    def _drop(self, o: Outgoing) -> None:
        o.move(TransferPhase.ENDED)
        del self.out[o.rid]

    def _transfer_event(self, rid: str, ok: bool, error: str, ms: float = 0.0,
                        busy: bool = False) -> None:
        self.emit(TransferResultEvent(rid, ok, error, ms, busy))

    def has_background_work(self) -> bool:
        return bool(self.out)

    def load(self) -> LoadReport:
        base = super().load()
        # Held past the lease as after_step judged it (so after_step already failed these;
        # blocks still held means the cancel never completed, so nothing else will free
        # them). Not a request still QUEUED or PREFILLING: no lease runs before token 0.
        at = self._judged_at or time.monotonic()
        orphans = sum(h.blocks for h in self.engine.held_requests()
                      if h.state not in (RequestState.QUEUED, RequestState.PREFILLING)
                      and (o := self.out.get(h.request_id)) is not None and at > o.lease_until)
        kv = self.sender.stats()
        return replace(
            base, transfers_in_flight=sum(1 for o in self.out.values() if o.started),
            kv_exhausted_by_orphans=exhausted_by_orphans(base.kv_blocks_free,
                                                         base.kv_blocks_total, orphans),
            transfer=TransferLoad(orphan_blocks=orphans, transfers_ok=self.transfers_ok,
                                  transfers_failed=self.transfers_failed, aborts=self.aborts,
                                  kv_malformed_messages=kv.malformed_messages,
                                  kv_rejected_handshakes=kv.rejected_handshakes),
            producer=ProducerLoad(lease_expiries=self.lease_expiries,
                                  kv_bytes_sent=self.kv_bytes_sent))

    def close(self) -> None:
        self.sender.close()
