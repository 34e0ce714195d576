"""The narrow seam between the generic engine loop and what a role does with requests."""

from __future__ import annotations

import abc
import time
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

from engine.outputs import RequestOutput, StepResult
from worker.load_report import DPRankLoad, LoadReport, PrefixCacheLoad
from worker.messages import Command, Event, ReadyInfo
from worker.token_batch import (
    NO_HANDOFF,
    Handoff,
    TokensBatchBuilder,
    TokensBatchEvent,
    TokensEvent,
)

if TYPE_CHECKING:  # the engine (torch) loads in the engine process only, never the gRPC one
    from engine.llm_engine import LLMEngine

Emit = Callable[[Event], None]


def now_ns() -> int:
    return time.time_ns()


def tokens_batch(outputs: Iterable[RequestOutput],
                 first_steps: dict[str, Handoff] | None = None) -> TokensBatchEvent:
    """One step's outputs as one columnar message. first_steps: rid -> its handoff's stamps
    (KV landed, first decode step launched, ...), taken (popped) for the requests of this
    step (consumer): only a request's first message carries them."""
    b = TokensBatchBuilder()
    for out in outputs:
        h = (first_steps.pop(out.request_id, None) if first_steps else None) or NO_HANDOFF
        b.add(out.request_id, out.new_token_ids, out.new_text, out.new_logprobs,
              out.finish_reason, stop_text(out.stop_reason), "", h.kv_ready_ns,
              h.first_step_ns, out.num_cached_tokens, h.notice_sent_ns, h.notice_seen_ns,
              h.kv_done_ns)
    return b.build()


def error_event(rid: str, finish: str, error: str) -> TokensEvent:
    return TokensEvent(rid, (), "", (), finish, error=error)


def stop_text(reason: int | str | None) -> str:
    return "" if reason is None else str(reason)


def _nothing() -> None:
    return None


class RoleHandler(abc.ABC):
    def __init__(self, engine: LLMEngine, emit: Emit) -> None:
        self.engine = engine
        self.emit = emit
        # Sends what was emitted so far now, ahead of the loop's own flush points (the
        # engine loop sets it to its outbox's): for events that must not wait for the rest
        # of the turn, as the producer's token 0 must not wait for the KV pushes.
        self.flush_events: Callable[[], None] = _nothing

    @abc.abstractmethod
    def on_command(self, cmd: Command) -> None:
        """Applies one command from the gRPC process."""

    @abc.abstractmethod
    def on_outputs(self, step: StepResult, step_end_ns: int) -> None:
        """Handles what one engine step reported (step_end_ns: when its forward ended)."""

    def before_step(self, now_ns: int) -> None:  # noqa: B027 - optional hook
        """Runs right before an engine step is launched."""

    def after_step(self) -> None:  # noqa: B027 - optional hook
        """Runs after every loop turn: transfers, leases, queued reservations."""

    def takes_during_step(self, cmd: Command) -> bool:
        """True for a command the role applies while its engine's step still runs on the
        device or is being launched (LLMEngine.device_wait, between_launches), rather than
        after it. Such a command must touch neither the engine's requests nor the running
        step; every command queued behind one that waits waits too, so they still apply in
        the order sent."""
        return False

    def command_wait_ms(self) -> int:
        """How long the loop should wait for a command before launching the next step (a
        reply the role expects within moments that would otherwise wait a whole step)."""
        return 0

    def awaiting_kv(self) -> bool:
        """True while KV transfers are in flight whose requests could join the next step
        (the loop then launches it late: worker/launch_pacer.py)."""
        return False

    def has_background_work(self) -> bool:
        """True while transfers or reservations need polling even with the engine idle."""
        return False

    def load(self) -> LoadReport:
        """The engine's queues, pool and counters; a role that moves KV adds its own with
        ``dataclasses.replace``."""
        acc = self.engine.block_accounting()
        return LoadReport(waiting=len(self.engine.scheduler.waiting),
                          running=len(self.engine.scheduler.running),
                          kv_blocks_free=acc.free, kv_blocks_total=acc.total,
                          preemptions=self.engine.num_preemptions,
                          dp_ranks=self._dp_loads(),
                          prefix_cache=PrefixCacheLoad.of(self.engine.prefix_cache_stats()))

    def _dp_loads(self) -> tuple[DPRankLoad, ...]:
        """Each attention data-parallel group's own queues and pool (none for one group)."""
        if self.engine.config.data_parallel_size == 1:
            return ()
        return tuple(DPRankLoad(d["waiting"], d["running"], d["kv_blocks_free"],
                                d["kv_blocks_total"]) for d in self.engine.scheduler.loads())

    def ready_info(self) -> ReadyInfo:
        cfg = self.engine.config
        return ReadyInfo(
            model=self.engine.model_name, kv_fingerprint=self.engine.layout.fingerprint(),
            max_model_len=self.engine.max_model_len,
            vocab_size=self.engine.model_cfg.vocab_size,
            kv_blocks_total=self.engine.block_accounting().total,
            tp_size=cfg.tensor_parallel_size, dp_size=cfg.data_parallel_size,
            block_size=cfg.block_size, prefix_caching=self.engine.blocks.cache is not None,
            accepts_cache_salt=True)

    def close(self) -> None:  # noqa: B027 - optional hook
        """Releases transfer resources at shutdown."""
