"""Joining the router: Register once the engine is ready, then heartbeat the load; register
again if the router forgot us (it restarted, or dropped us after missed heartbeats). Each
heartbeat's answer carries the router's orders (a role change it wants). Leaving: Deregister
(draining: no new work comes) and, once drained, Deregister(done). A worker whose engine
failed leaves at once (Deregister(done)) and never registers again: it serves nothing until
it restarts, and between the failure and its exit (the engine stops its TP ranks and
transfer endpoints first) the router would otherwise place new requests on it.

Liveness travels apart from the data plane: the heartbeats leave from their own
thread over their own (sync) gRPC channel, one call a heartbeat (its answer carries the
router's orders), so an event loop saturated by token streams
cannot delay them past the router's timeout; the router would take a busy worker for a dead
one and fail all its requests. The thread reports how far behind the loop is instead
(``LoopWatch``: a ticker task on the loop stamps the time, the thread reads how late it is)
and the age of the engine process's last load report, and the router stops placing new
requests on a worker that is behind (busy) without dropping it. Lifecycle: ``run()`` starts
the ticker and the thread and ends them when it is cancelled or the router refuses the
worker (raised from ``run()``); ``close()`` closes the channel (cancelling a call in flight)
and waits for the thread. What the router sends back for the loop (a role-change order)
crosses over with ``loop.call_soon_threadsafe``."""

from __future__ import annotations

import asyncio
import contextlib
import importlib.metadata
import logging
import threading
import time
from collections.abc import Callable
from typing import Any, cast

import grpc
from pdserve.v1 import common_pb2, router_pb2, router_pb2_grpc, worker_pb2, worker_pb2_grpc

from worker.load_report import LoadReport
from worker.messages import ReadyInfo

log = logging.getLogger("pdserve.worker")
ROLES = {"producer": common_pb2.ROLE_PRODUCER, "consumer": common_pb2.ROLE_CONSUMER,
         "colocated": common_pb2.ROLE_COLOCATED}
# The loop's ticker period: the resolution of the reported lag, at ten cheap wakeups a second.
TICK_S = 0.1
# Router calls from the heartbeat thread. Shorter than the router's heartbeat timeout (3 s by
# default) would only fail calls to a router that is itself stalled; longer would delay a
# re-registration after one.
CALL_TIMEOUT_S = 5.0
# Answers that mean "this worker may not join" (a retry cannot change them): run() raises.
REFUSED = (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.INVALID_ARGUMENT,
           grpc.StatusCode.FAILED_PRECONDITION)


def pdserve_version() -> str:
    try:
        return importlib.metadata.version("pdserve")
    except importlib.metadata.PackageNotFoundError:  # run from a source tree
        return "unknown"


def load_pb(r: LoadReport | None) -> common_pb2.WorkerLoad:
    """The heartbeat's view of the engine's latest report (None before the first: empty)."""
    if r is None:
        return common_pb2.WorkerLoad()
    return common_pb2.WorkerLoad(
        waiting=r.waiting, running=r.running, kv_blocks_free=r.kv_blocks_free,
        kv_blocks_total=r.kv_blocks_total, transfers_in_flight=r.transfers_in_flight,
        kv_exhausted_by_orphans=r.kv_exhausted_by_orphans,
        dp_ranks=[common_pb2.DPRankLoad(waiting=d.waiting, running=d.running,
                                        kv_blocks_free=d.kv_blocks_free,
                                        kv_blocks_total=d.kv_blocks_total)
                  for d in r.dp_ranks])


class LoopWatch:
    """How far behind an event loop runs, read from another thread.

    ``tick`` runs on the loop every ``tick_s``: from a timer, or from ``poke`` (the loop's own
    work arriving, such as the engine's events), which then moves the timer on. So a busy
    loop ticks without a wake-up of its own: a timer's wake-up of an otherwise idle loop
    cost ~0.3 ms of CPU on a 2-core VM, and ten a second were a quarter of a consumer's gRPC
    process at 1k tokens/s. ``read`` (the heartbeat thread) sees a loop
    that is stuck now (its tick overdue) as well as one that was stuck since the last read
    and caught up (the worst lateness a tick saw). The engine process's reports arrive on the
    same loop (``EngineBridge.pump`` keeps the latest, a new object each time), so their age
    is taken in loop time, at each tick: a stalled loop shows as loop lag, not as a stale
    engine.
    """

    def __init__(self, load: Callable[[], object], tick_s: float = TICK_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.tick_s = tick_s
        self._clock = clock
        self._load = load
        self.ticked = clock()  # when the loop last ran its tick
        # The worst lateness since the last read. The thread's reset may lose one tick's
        # update to a race with the loop: one heartbeat then under-reports a past stall,
        # never a stall in progress (read from ``ticked``).
        self.peak = 0.0
        self._seen: object = None
        self._seen_at = self.ticked
        self.engine_age = 0.0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._timer: asyncio.TimerHandle | None = None

    async def run(self) -> None:
        """Ticks until cancelled."""
        self._loop = asyncio.get_running_loop()
        self._arm()
        try:
            await self._loop.create_future()
        finally:
            if self._timer is not None:
                self._timer.cancel()
            self._loop = self._timer = None

    def _arm(self) -> None:
        assert self._loop is not None
        self._timer = self._loop.call_later(self.tick_s, self._fire)

    def _fire(self) -> None:
        self.tick()
        self._arm()

    def poke(self) -> None:
        """The loop is running other work now: tick here (at most every half period, so a
        busy loop pays for it a few times a tick) and move the timer on."""
        if self._timer is None or self._clock() - self.ticked < self.tick_s / 2:
            return
        self._timer.cancel()
        self.tick()
        self._arm()

    def tick(self) -> None:
        now = self._clock()
        late = max(0.0, now - self.ticked - self.tick_s)
        self.peak = max(self.peak, late)
        self.ticked = now
        load = self._load()
        if load is not self._seen:  # a new report (each one is a new object)
            self._seen, self._seen_at = load, now
        else:  # the reports waiting behind a stalled loop are not the engine's delay
            self._seen_at = min(now, self._seen_at + late)
        self.engine_age = now - self._seen_at

    def read(self) -> tuple[float, float]:
        """(loop lag, engine report age) in seconds, for one heartbeat."""
        lag = max(0.0, self._clock() - self.ticked - self.tick_s, self.peak)
        self.peak = 0.0
        return lag, self.engine_age


class Registration:
    def __init__(self, router: str, worker_id: str, role: str, address: str,
                 info: ReadyInfo, load: Callable[[], LoadReport | None],
                 cluster_token: str = "", router_ca: str = "",
                 failed: Callable[[], str | None] = lambda: None,
                 outputs_address: str = "", outputs_unix: str = "") -> None:
        self.outputs_address = outputs_address  # the plain-TCP Outputs stream ("": none)
        self.outputs_unix = outputs_unix  # the same on an abstract Unix socket ("": none)
        if router_ca:  # the router serves TLS (--tls-cert): verify it with this CA
            with open(router_ca, "rb") as f:
                creds = grpc.ssl_channel_credentials(root_certificates=f.read())
            self.channel = grpc.secure_channel(router, creds)
        else:
            self.channel = grpc.insecure_channel(router)
        self.stub = worker_pb2_grpc.RegistryStub(self.channel)
        self.membership = router_pb2_grpc.MembershipStub(self.channel)
        self.worker_id = worker_id
        self.role = role
        self.address = address
        self.info = info
        self.load = load
        self.token = cluster_token
        self.interval = 1.0
        self.draining = False  # set once deregistered: never register again
        self.change_role = 0  # common_pb2.Role the router ordered (0: none); set on the loop
        self.ordered = asyncio.Event()  # set (on the loop) when change_role is
        self.failed = failed  # why the engine failed (None while it serves)
        self.left = False  # told the router so (once)
        self.watch = LoopWatch(load)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._order_seen = False  # the thread's own copy of "ordered": handed on once

    # -- the loop's side -------------------------------------------------------------------

    async def run(self) -> None:
        """Registers (retrying while the router is not up) and heartbeats until cancelled;
        raises RuntimeError if the router refuses this worker."""
        loop = asyncio.get_running_loop()
        refused: asyncio.Future[None] = loop.create_future()
        self._stop.clear()
        ticker = asyncio.create_task(self.watch.run())
        self._thread = threading.Thread(target=self._main, args=(loop, refused), daemon=True,
                                        name=f"{self.worker_id}-heartbeat")
        self._thread.start()
        try:
            await refused
        finally:
            self._stop.set()
            ticker.cancel()

    async def register(self) -> None:
        await asyncio.to_thread(self._register)

    async def deregister(self, reason: str, done: bool = False, timeout: float = 5.0) -> bool:
        """Tells the router to stop sending work (done: to forget this worker). False when
        the router could not be told (gone, or did not know us): nothing to wait for then."""
        self.draining = True
        return await asyncio.to_thread(self._deregister, reason, done, timeout)

    async def close(self) -> None:
        self._stop.set()
        self.channel.close()  # ends a call in flight, so the thread sees the stop at once
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, CALL_TIMEOUT_S)

    def _on_order(self, role: int) -> None:
        self.change_role = role
        self.ordered.set()

    # -- the heartbeat thread --------------------------------------------------------------

    def _main(self, loop: asyncio.AbstractEventLoop, refused: asyncio.Future[None]) -> None:
        try:
            self._beat(loop, refused)
        except Exception as e:  # noqa: BLE001 - a dead thread would leave the worker silent
            log.exception("the heartbeat thread failed")
            _call_soon(loop, _set_exception, refused, e)

    def _beat(self, loop: asyncio.AbstractEventLoop, refused: asyncio.Future[None]) -> None:
        registered = False
        while not self._stop.is_set():
            # Heartbeats start on a fixed cadence, not an interval after the last one ended:
            # in a process starved of CPU a call takes a second or more, and sleeping the
            # interval after it stretched the router's gaps to interval + call (2-3 s against
            # its 3 s timeout; the overload test's consumer was dropped that way once).
            started = time.monotonic()
            if (why := self.failed()) is not None:
                # No heartbeat (it would keep this worker placeable) and no register (after
                # the router dropped it for its failed requests, that would bring it back as
                # a new registration, which the requests that failed here do not exclude).
                if not self.left:
                    self.left = True
                    log.warning("engine failed: leaving the router (%s)", why)
                    self.draining = True
                    self._deregister(f"engine failed: {why}", True, CALL_TIMEOUT_S)
                self._stop.wait(self.interval)
                continue
            try:
                if not registered and not self.draining:
                    self._register()
                    registered = True
                elif registered:
                    resp = self.stub.Heartbeat(worker_pb2.HeartbeatRequest(
                        worker_id=self.worker_id, load=self._load_pb(),
                        cluster_token=self.token), timeout=CALL_TIMEOUT_S)
                    registered = resp.known
                    if registered and resp.change_role:
                        self._order(loop, int(resp.change_role))
            except grpc.RpcError as e:
                if self._stop.is_set():
                    return
                call = cast(grpc.Call, e)
                if call.code() in REFUSED:
                    err = RuntimeError(f"the router refused this worker: {call.details()}")
                    _call_soon(loop, _set_exception, refused, err)
                    return
                log.warning("router unreachable (%s); retrying", call.code().name)
                registered = False
            except ValueError:  # the channel was closed under us (close() during a call)
                return
            # (the interval read now: a registration's answer sets it)
            self._stop.wait(max(0.0, started + self.interval - time.monotonic()))

    def _load_pb(self) -> common_pb2.WorkerLoad:
        out = load_pb(self.load())
        out.loop_lag_s, out.engine_report_age_s = self.watch.read()
        return out

    def _register(self) -> None:
        resp = self.stub.Register(worker_pb2.RegisterRequest(
            worker_id=self.worker_id, role=ROLES[self.role], address=self.address,
            kv_address=self.info.kv_address, model=self.info.model,
            kv_fingerprint=self.info.kv_fingerprint,
            max_model_len=self.info.max_model_len, load=self._load_pb(),
            cluster_token=self.token, tp_size=self.info.tp_size, dp_size=self.info.dp_size,
            lease_s=self.info.lease_s, block_size=self.info.block_size,
            prefix_caching=self.info.prefix_caching,
            accepts_cache_salt=self.info.accepts_cache_salt,
            version=pdserve_version(), outputs_address=self.outputs_address,
            outputs_unix=self.outputs_unix), timeout=10)
        self.interval = resp.heartbeat_interval_s or 1.0
        log.info("registered with the router as %s (%s)", self.worker_id, self.role)

    def _order(self, loop: asyncio.AbstractEventLoop, role: int) -> None:
        """A role change the router ordered, handed to the loop once."""
        if not self._order_seen and role in ROLES.values():
            self._order_seen = True
            _call_soon(loop, self._on_order, role)

    def _deregister(self, reason: str, done: bool, timeout: float) -> bool:
        try:
            resp = self.membership.Deregister(router_pb2.DeregisterRequest(
                worker_id=self.worker_id, cluster_token=self.token, done=done, reason=reason),
                timeout=timeout)
        except grpc.RpcError as e:
            call = cast(grpc.Call, e)
            log.warning("could not deregister from the router (%s): %s", call.code().name,
                        call.details())
            return False
        except ValueError:  # closed channel: the worker is stopping
            return False
        return bool(resp.known)


def _set_exception(fut: asyncio.Future[None], err: BaseException) -> None:
    if not fut.done():
        fut.set_exception(err)


def _call_soon(loop: asyncio.AbstractEventLoop, fn: Callable[..., None], *args: Any) -> None:
    # the loop may be gone already (the worker is stopping): nothing is waiting then
    with contextlib.suppress(RuntimeError):
        loop.call_soon_threadsafe(fn, *args)
