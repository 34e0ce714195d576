"""A colocated worker: one engine runs both phases and streams tokens 0..n (deferred output)."""

from __future__ import annotations

from typing import Any

from engine.outputs import RequestOutput
from engine.scheduler import QueueFull
from worker import ipc
from worker.role import RoleHandler, error_event, sampling_from_wire, tokens_event


class ColocatedHandler(RoleHandler):
    def on_command(self, cmd: list[Any]) -> None:
        kind, rid = cmd[0], cmd[1]
        if kind == ipc.CMD_DECODE:
            try:
                self.engine.add_request(rid, list(cmd[2]), sampling_from_wire(cmd[3]))
            except (ValueError, QueueFull) as e:
                self.emit(error_event(rid, "error", str(e)))
        elif kind == ipc.CMD_ABORT:
            if self.engine.abort(rid):
                self.emit(error_event(rid, "abort", "aborted"))

    def on_outputs(self, outs: list[RequestOutput], step_end_ns: int) -> None:
        for out in outs:
            self.emit(tokens_event(out))
