"""Live role changes (``Admin.ChangeSplit``): a running cluster moves to a new split of the
workers it has, without a restart and without losing a request.

Lifecycle of one change (one at a time per router):

    planned ──▶ for each step, in order:
                  ordered   registry.order_role_change: the worker is draining (never
                            picked for new work, its in-flight requests go on) and has a
                            target role, which it reads from its next heartbeat's answer
                  ──▶ the worker drains (its --drain-timeout), rebuilds its engine in the
                      new role in place and Registers again (same id, same address);
                      while it rebuilds it sends no heartbeat, which is planned: the
                      changer keeps its entry alive (``_expect_silence``) so the sweep
                      neither drops it nor logs it as a lost worker
                  registered  a new incarnation in the target role: the next step starts
                [guard: step_timeout_s per step; past it, or if the worker comes back in
                 another role, the change stops there with an error]
           ──▶ done | failed

Steps run one at a time, ordered so that the rest of the cluster keeps serving while a
worker rebuilds whenever the split allows it. When it cannot (1P1D has one pair; rebuilding
either half leaves none), ``registry.hold_until`` makes new requests wait for the step
instead of failing (router/requests/health.py ``wait_until_serving``).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from pdserve.v1 import router_pb2

from router.control.registry import COLOCATED, CONSUMER, PRODUCER, ROLE_NAMES, Registry, WorkerInfo

log = logging.getLogger(__name__)

# drain (the workers' default --drain-timeout is 25 s) + engine rebuild + re-registration
DEFAULT_STEP_TIMEOUT_S = 300.0
ROLES = (PRODUCER, CONSUMER, COLOCATED)

Progress = Callable[[router_pb2.ChangeSplitProgress], None]


class SplitError(ValueError):
    """A split the router cannot move to; the message starts with the offending field."""


@dataclass(frozen=True)
class Step:
    worker_id: str
    from_role: int
    to_role: int

    def describe(self) -> str:
        return (f"{self.worker_id}: {ROLE_NAMES[self.from_role]} -> "
                f"{ROLE_NAMES[self.to_role]}")


def as_role(role: int) -> str:
    """"a consumer", "a colocated worker": a role in a sentence."""
    return "a colocated worker" if role == COLOCATED else f"a {ROLE_NAMES[role]}"


def serves(roles: Iterable[int]) -> bool:
    rs = list(roles)
    return COLOCATED in rs or (PRODUCER in rs and CONSUMER in rs)


def plan_split(registry: Registry, producers: int, consumers: int,
               colocated: int) -> list[Step]:
    """Which workers change role, and in which order. The fewest workers change; among
    the workers of a role with too many, the least busy go first."""
    workers = [w for w in registry.all() if not w.draining]
    total = producers + consumers + colocated
    if total != len(workers):
        raise SplitError(f"producers + consumers + colocated: must add up to the "
                         f"{len(workers)} registered worker(s) not draining, got {total}")
    if (producers == 0) != (consumers == 0):
        raise SplitError(f"producers/consumers: a disaggregated split needs at least one of "
                         f"each (or neither), got {producers} and {consumers}")
    target = {PRODUCER: producers, CONSUMER: consumers, COLOCATED: colocated}
    moving: list[WorkerInfo] = []
    wanted: list[int] = []
    for role in ROLES:
        have = sorted((w for w in workers if w.role == role),
                      key=lambda w: (w.inflight, w.worker_id))
        moving += have[:max(0, len(have) - target[role])]
        wanted += [role] * max(0, target[role] - len(have))
    steps = [Step(w.worker_id, w.role, to) for w, to in zip(moving, wanted, strict=True)]
    return order_steps({w.worker_id: w.role for w in workers}, steps)


def order_steps(roles: dict[str, int], steps: list[Step]) -> list[Step]:
    """Greedy: next comes a step during which the others still serve, else one after which
    the cluster serves again; ties keep the plan's order."""
    roles = dict(roles)
    left, out = list(steps), []
    while left:
        def badness(s: Step) -> tuple[bool, bool]:
            others = [r for wid, r in roles.items() if wid != s.worker_id]
            return (not serves(others), not serves([*others, s.to_role]))

        step = min(left, key=badness)
        left.remove(step)
        out.append(step)
        roles[step.worker_id] = step.to_role
    return out


def progress_msg(step: Step | None, state: str, message: str, *, done: bool = False,
                 error: str = "") -> router_pb2.ChangeSplitProgress:
    kw = {}
    if step is not None:
        kw = dict(worker_id=step.worker_id, from_role=step.from_role, to_role=step.to_role)
    return router_pb2.ChangeSplitProgress(state=state, message=message, done=done, error=error,
                                          **kw)  # type: ignore[arg-type]


class RoleChanger:
    """Runs one change at a time, as a task of its own: a client that hangs up does not
    leave a cluster half changed."""

    def __init__(self, registry: Registry) -> None:
        self.registry = registry
        self.task: asyncio.Task[None] | None = None

    @property
    def running(self) -> bool:
        return self.task is not None and not self.task.done()

    def start(self, steps: list[Step], step_timeout_s: float, progress: Progress) -> None:
        if self.running:
            raise SplitError("a role change is already running")
        self.task = asyncio.get_running_loop().create_task(
            self._run(steps, step_timeout_s, progress))

    async def close(self) -> None:
        if self.task is not None:
            self.task.cancel()
            try:
                await self.task
            except asyncio.CancelledError:
                pass
        self.registry.hold_until = 0.0

    async def _run(self, steps: list[Step], step_timeout_s: float, progress: Progress) -> None:
        error = ""
        try:
            for step in steps:
                error = await self._step(step, step_timeout_s, progress)
                if error:
                    break
        finally:
            self.registry.hold_until = 0.0
        if error:
            log.error("role change stopped: %s", error)
            progress(progress_msg(None, "failed", f"role change stopped: {error}", done=True,
                                  error=error))
        else:
            log.info("role change done (%d step(s))", len(steps))
            progress(progress_msg(None, "done", f"role change done ({len(steps)} step(s))",
                                  done=True))

    async def _step(self, step: Step, timeout_s: float, progress: Progress) -> str:
        reg = self.registry
        old = reg.get(step.worker_id)
        if old is None or old.role != step.from_role:
            return f"{step.worker_id} is no longer registered as {ROLE_NAMES[step.from_role]}"
        reg.hold_until = reg.clock() + timeout_s
        reg.order_role_change(step.worker_id, step.to_role)
        log.info("role change: %s (%s) leaves for a planned change to %s: draining (no new "
                 "requests; those in flight finish)", step.worker_id,
                 ROLE_NAMES[step.from_role], ROLE_NAMES[step.to_role])
        progress(progress_msg(step, "draining", f"{step.describe()}: draining"))
        end = reg.clock() + timeout_s
        silent_since = 0.0
        while True:
            w = reg.get(step.worker_id)
            if w is old:
                silent_since = self._expect_silence(step, old, silent_since)
            if w is not None and w is not old:  # it registered again
                if w.role != step.to_role:
                    return (f"{step.worker_id} came back as {w.role_name}, not "
                            f"{ROLE_NAMES[step.to_role]}")
                log.info("role change: %s registered again, now %s (planned: %s)",
                         step.worker_id, as_role(step.to_role), step.describe())
                progress(progress_msg(step, "registered", f"{step.describe()}: registered"))
                return ""
            if reg.clock() > end:
                return (f"{step.worker_id} did not register as {ROLE_NAMES[step.to_role]} "
                        f"within {timeout_s:g} s")
            await asyncio.sleep(0.1)

    def _expect_silence(self, step: Step, old: WorkerInfo, silent_since: float) -> float:
        """A worker ordered to change role stops heartbeating while it rebuilds: planned,
        not a failure. Its (draining, never picked) entry is kept alive until it registers
        again or the step times out (then the sweep drops it as any silent worker). Returns
        when the silence began (0: it still heartbeats)."""
        now = self.registry.clock()
        if not silent_since and now - old.last_heartbeat <= min(
                1.0, self.registry.heartbeat_timeout_s / 2):
            return 0.0
        if not silent_since:
            # worded for an operator who greps the log for lost workers: nothing here is one
            log.info("role change: %s is rebuilding as %s: silent until it registers again, "
                     "as planned", step.worker_id, as_role(step.to_role))
            silent_since = now
        old.last_heartbeat = now  # what a heartbeat would do: the sweep leaves it be
        return silent_since
