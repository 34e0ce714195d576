"""Admits and places requests, lists the ones in flight, and routes outside events to them.

Each request's legs, their pairing, watching and teardown belong to its ``RequestRun``;
the dispatcher owns what outlives a request: the background tasks its teardown spawns
(``Worker.Abort`` calls, lingering legs), which ``close`` waits for at shutdown.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Coroutine
from typing import Any

import grpc
from pdserve.v1 import router_pb2

from router.config import RouterConfig
from router.control.kv_index import KVIndex
from router.control.policy import LocalPrefill, Policy, Slot, place
from router.control.prefix_lookup import PrefixLookup
from router.control.registry import COLOCATED, CONSUMER, PRODUCER, ROLE_NAMES, Registry, WorkerInfo
from router.requests.admission import Admission
from router.requests.channels import WorkerChannels
from router.requests.direct_write import DirectWrite
from router.requests.errors import Overloaded, RequestError
from router.requests.request_info import RequestInfo
from router.requests.request_run import RequestRun
from router.requests.run_events import Aborted, Dropped, Failed
from router.requests.validation import PreparedRequest

log = logging.getLogger(__name__)


class Dispatcher:
    def __init__(self, registry: Registry, policy: Policy, channels: WorkerChannels,
                 config: RouterConfig, kv_index: KVIndex | None = None) -> None:
        self.registry = registry
        self.policy = policy
        self.kv_index = kv_index if kv_index is not None else KVIndex()
        # decided from the index, so only under the policy that follows it
        self.local_prefill = LocalPrefill(config.local_prefill_max_tokens
                                          if policy.name == "cache_aware" else -1)
        self.channels = channels
        self.config = config
        self.active: dict[str, RequestRun] = {}
        self.prefill_retries = 0  # placements after a producer failed before token 0
        self.migrations = 0  # placements after a later failure, with the tokens streamed
        self._background: set[asyncio.Task[Any]] = set()
        registry.on_drop.append(self._on_worker_drop)

    async def generate(self, prep: PreparedRequest, received_ns: int, admission: Admission,
                       direct: DirectWrite | None = None
                       ) -> AsyncIterator[router_pb2.GenerateResponse]:
        """Queues the request for an admission slot, places it, streams its responses.

        Refusals raise RequestError before the first response. ``direct``: the client's
        gRPC stream, which steady-state tokens may be written to without passing here.
        """
        if prep.request_id in self.active:
            raise RequestError(grpc.StatusCode.ALREADY_EXISTS,
                               f"request_id: {prep.request_id!r} is already in flight")
        lookup = PrefixLookup(self.kv_index, prep.prompt_token_ids, prep.cache_salt)
        run = RequestRun(prep, received_ns, self.config,
                         stub_for=self.channels.stub,
                         outputs_for=self.channels.outputs,
                         on_unreachable=self._unreachable, spawn=self._spawn,
                         replace=lambda failed, migration: self._replace(failed, migration,
                                                                         lookup),
                         direct=direct)
        self.active[prep.request_id] = run  # listed as QUEUED while it waits for a slot
        try:
            async with admission.slot(run.stopped) as admitted:
                if admitted:
                    slot = self._place([], lookup)
                    if slot is None:
                        raise RequestError(grpc.StatusCode.UNAVAILABLE,
                                           no_workers_message(self.registry))
                    run.place(slot)
                # not admitted: aborted in the queue; its stream ends with that, no legs
                async for resp in run.stream():
                    yield resp
        finally:
            run.close()  # the stream's own close, in case it never started or was not closed
            self.active.pop(prep.request_id, None)

    def requests(self) -> list[RequestInfo]:
        """Every request the router holds now, oldest first."""
        return sorted((r.info() for r in self.active.values()), key=lambda i: -i.age_s)

    def abort(self, request_id: str) -> bool:
        run = self.active.get(request_id)
        if run is None:
            return False
        run.post(Aborted())
        return True

    async def close(self) -> None:
        for run in list(self.active.values()):
            run.post(Failed("router shutting down"))
        # Give the handlers a moment to emit their final message and queue their aborts.
        for _ in range(50):
            if not self.active:
                break
            await asyncio.sleep(0.01)
        tasks = list(self._background)
        if tasks:
            await asyncio.wait(tasks, timeout=self.config.abort_timeout_s + 0.5)
        for t in self._background:
            t.cancel()

    # -- internals -------------------------------------------------------------------------

    def _replace(self, failed: list[WorkerInfo], migration: bool,
                 lookup: PrefixLookup | None = None) -> Slot | None:
        slot = self._place(failed, lookup)
        if slot is not None and migration:
            self.migrations += 1
        elif slot is not None:
            self.prefill_retries += 1
        return slot

    def _place(self, exclude: list[WorkerInfo], lookup: PrefixLookup | None = None
               ) -> Slot | None:
        """A slot for a new request (``exclude`` empty) or for a running one whose worker
        failed (``exclude`` names it). None: no worker can take it (UNAVAILABLE). A new
        request is never placed on a busy worker (behind, ``Registry.placeable``): when
        only busy workers could take it, it is refused with RESOURCE_EXHAUSTED (429) and a
        retry hint, since the cluster is alive and will take it once they catch up. A
        running request goes to a busy worker rather than fail its client mid-stream."""
        if not self.registry.serving():
            return None
        # conditional local prefill decides for new requests only (a retried or migrated
        # one goes back to P/D: the consumer it would prefill on is a new choice anyway)
        local = self.local_prefill if not exclude else None
        slot = place(self.registry, self.policy, exclude, lookup=lookup, local=local)
        if slot is None and exclude:
            slot = place(self.registry, self.policy, exclude, busy_ok=True, lookup=lookup)
        elif slot is None and place(self.registry, self.policy, busy_ok=True,
                                    lookup=lookup) is not None:
            raise Overloaded(busy_message(self.registry, self.config.retry_after_s),
                             self.config.retry_after_s)
        return slot

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    def _on_worker_drop(self, w: WorkerInfo, reason: str) -> None:
        # Replaced by a new registration: its first call opens the new channel. Gone: close.
        if self.registry.get(w.worker_id) is None:
            self.channels.drop(w.worker_id)
        for run in self.active.values():
            if run.slot is not None and any(x is w for x in run.slot.workers):
                run.post(Dropped(w, reason))

    def _unreachable(self, w: WorkerInfo, message: str) -> None:
        if self.registry.get(w.worker_id) is w:
            log.warning("dropping %s %s: %s", w.role_name, w.worker_id, message)
            self.registry.remove(w.worker_id, message)


def no_workers_message(registry: Registry) -> str:
    p, c, co = (len(registry.usable(r)) for r in (PRODUCER, CONSUMER, COLOCATED))
    return (f"no workers can take the request: {p} producer(s), {c} consumer(s), {co} colocated "
            f"usable; need a producer and a consumer, or a colocated worker")


BUSY_NOUNS = {PRODUCER: ("producer", "producers"), CONSUMER: ("consumer", "consumers"),
              COLOCATED: ("colocated worker", "colocated workers")}


def busy_message(registry: Registry, retry_after_s: float) -> str:
    """Why a new request was refused while workers that could take it are alive but behind:
    which pools have no worker keeping up, and how far behind each busy one is."""
    placeable = {r: len(registry.placeable(r)) for r in ROLE_NAMES}
    blocked = []  # roles that a slot needs and whose every usable worker is busy
    if not placeable[COLOCATED]:
        if not placeable[CONSUMER]:
            blocked.append(CONSUMER)
        if not placeable[PRODUCER]:
            blocked.append(PRODUCER)
        blocked.append(COLOCATED)
    pools = [f"all {n} {BUSY_NOUNS[r][n != 1]} {'are' if n != 1 else 'is'} busy"
             for r in blocked if (n := len(registry.usable(r)))]
    why = "; ".join(f"{w.worker_id}: {registry.busy_reason(w)}" for w in registry.busy())
    return (f"{' and '.join(pools) or 'every worker that could take it is busy'}: {why}; "
            f"retry after {retry_after_s:g} s")
