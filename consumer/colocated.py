"""A colocated worker: one engine runs both phases and streams tokens 0..n (deferred output)."""

from __future__ import annotations

from engine.outputs import StepResult
from engine.scheduler import QueueFull
from worker.messages import AbortCmd, Command, DecodeCmd
from worker.role import RoleHandler, error_event, tokens_batch


class ColocatedHandler(RoleHandler):
    def on_command(self, cmd: Command) -> None:
        if isinstance(cmd, DecodeCmd):
            try:
                self.engine.add_request(cmd.rid, list(cmd.prompt_ids),
                                        cmd.sampling, list(cmd.prior_ids),
                                        cmd.cache_salt or None,
                                        dp_rank=cmd.dp_rank if cmd.dp_rank >= 0 else None)
            except (ValueError, QueueFull) as e:
                self.emit(error_event(cmd.rid, "error", str(e)))
        elif isinstance(cmd, AbortCmd):
            if self.engine.abort(cmd.rid):
                self.emit(error_event(cmd.rid, "abort", "aborted"))

    def on_outputs(self, step: StepResult, step_end_ns: int) -> None:
        if step.outputs:  # one message for the whole step
            self.emit(tokens_batch(step.outputs))
