"""The foreground life of a worker process (`pdserve producer|consumer|colocated`): serve,
drain on SIGTERM and exit 0, and change role in place when the router orders it.

A role change rebuilds the worker inside the same process: drain (worker/drain.py), stop
the gRPC server and the engine process, start an engine process and a gRPC server of the
new role on the same port under the same worker id, and Register again. In place rather
than "exit and let a supervisor restart it in the new role": only `pdserve launch` has a
supervisor that could pick the new role; SLURM runs the command once and a Kubernetes pod
restarts with the role its manifest names, so an exit would lose the change (or the
worker) there, while a rebuild in place works under every launcher.

SIGINT stops at once (no drain); a second SIGTERM during a drain does the same.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import signal
from collections.abc import Callable, Coroutine
from typing import Any

from worker.drain import DEFAULT_DRAIN_TIMEOUT_S, DrainGate, drain
from worker.heap import freeze_startup_heap, space_full_collections
from worker.registration import ROLES
from worker.server import WorkerConfig, WorkerServer

log = logging.getLogger("pdserve.worker")
ROLE_OF = {v: k for k, v in ROLES.items()}


class _Signals:
    def __init__(self) -> None:
        self.term = asyncio.Event()  # drain, then stop
        self.now = asyncio.Event()  # stop without draining

    def install(self) -> None:
        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGINT, self.now.set)
        loop.add_signal_handler(signal.SIGTERM, self._on_term)

    def _on_term(self) -> None:
        if self.term.is_set():
            self.now.set()
        self.term.set()


async def _first(*aws: asyncio.Future[object] | asyncio.Task[object]) -> None:
    await asyncio.wait(aws, return_when=asyncio.FIRST_COMPLETED)


def _failed(waiter: asyncio.Task[object]) -> int:
    """Exit status 1 for a worker whose engine or registration failed (a supervisor then
    restarts it as a crash), with its error in the log."""
    err = waiter.exception() if not waiter.cancelled() else None
    log.error("%s", err or "the worker stopped serving")
    return 1


async def serve(config_for: Callable[[str], WorkerConfig], role: str,
                drain_timeout_s: float = DEFAULT_DRAIN_TIMEOUT_S,
                signals: _Signals | None = None) -> int:
    """Runs the worker until SIGTERM (drained: 0), SIGINT (0) or a failure (1)."""
    sig = signals or _Signals()
    if signals is None:
        sig.install()
    cfg = config_for(role)
    while True:
        gate = DrainGate()
        w = WorkerServer(dataclasses.replace(cfg, interceptors=(gate,)))
        gate.worker_id = w.worker_id
        tasks: list[asyncio.Task[object]] = []
        try:
            starting = asyncio.create_task(w.start())
            interrupted = asyncio.create_task(sig.now.wait())
            tasks = [interrupted]
            await _first(starting, interrupted)
            if not starting.done():
                starting.cancel()
                return 0
            addr = starting.result()
            print(f"{w.worker_id} ({role}) listening on {addr}", flush=True)
            freeze_startup_heap()  # worker/heap.py: no full collection walks the imports
            space_full_collections()  # nor, as often, the requests in flight
            reg = w.registration
            assert reg is not None
            interrupted.cancel()
            tasks = [asyncio.create_task(w.wait()), asyncio.create_task(sig.term.wait()),
                     asyncio.create_task(sig.now.wait()), asyncio.create_task(reg.ordered.wait())]
            waiter, term, now, ordered = tasks
            await _first(*tasks)
            if waiter.done():
                return _failed(waiter)
            if now.done():
                return 0
            if term.done():
                drained = asyncio.create_task(
                    drain(w.bridge, gate, reg, "SIGTERM", drain_timeout_s))  # type: ignore[arg-type]
                await _first(drained, tasks[2])
                if not drained.done():
                    drained.cancel()
                await reg.deregister("SIGTERM, drained", done=True)
                return _failed(waiter) if waiter.done() else 0
            new_role = ROLE_OF[reg.change_role]
            log.info("%s: the router ordered a role change %s -> %s", w.worker_id, role,
                     new_role)
            await drain(w.bridge, gate, reg, f"changing role to {new_role}",  # type: ignore[arg-type]
                        drain_timeout_s, deregister=False)
            if waiter.done():  # the engine died while draining
                return _failed(waiter)
            if sig.term.is_set():  # told to stop while draining for the change
                await reg.deregister("SIGTERM, drained", done=True)
                return 0
            port = int(addr.rsplit(":", 1)[1])
            metrics_port = w.metrics_server.port if w.metrics_server is not None else -1
            outputs_port = w.outputs_port.port if w.outputs_port is not None else -1
        except Exception as e:  # noqa: BLE001 - one line for the log, exit 1 for the supervisor
            log.error("%s: %s: %s", w.worker_id, type(e).__name__, e)
            return 1
        finally:
            for t in tasks:
                t.cancel()
            await w.stop()
        # the same identity and ports: the router and peers keep dialing the same address
        role = new_role
        cfg = dataclasses.replace(config_for(role), port=port, metrics_port=metrics_port,
                                  outputs_port=outputs_port, worker_id=w.worker_id)


def run_worker_roles(config_for: Callable[[str], WorkerConfig], role: str,
                     drain_timeout_s: float = DEFAULT_DRAIN_TIMEOUT_S,
                     run: Callable[[Coroutine[Any, Any, int]], int] = asyncio.run) -> int:
    """Foreground entry point: ``config_for(role)`` builds the worker of any role (a role
    change needs the others' parts; the role packages are chosen where the command is
    parsed, since worker/ never imports them). ``run`` runs the worker's coroutine to its
    end on an event loop (the command's --event-loop: deploy/event_loop.py)."""
    logging.basicConfig(level=logging.INFO, format="[%(name)s] %(message)s")
    if role not in ROLES:
        raise ValueError(f"role: must be one of {', '.join(ROLES)}, got {role!r}")
    return run(serve(config_for, role, drain_timeout_s))
