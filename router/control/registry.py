"""Workers known to the router: fed by Register/Heartbeat, aged out by a sweep.

Pure bookkeeping (no gRPC, no asyncio) so policies and tests can use it directly. The
router's own count of requests it has in flight on each worker (``inflight``) is kept
here too: heartbeats report load once a second, which is stale for a burst of requests.

A worker's life here: registered (usable) -> draining (``Deregister``, or a role change
ordered by the router: listed, heartbeating, its in-flight requests running, never picked
for new work) -> gone (``Deregister(done)``, a missed heartbeat deadline, or replaced by
its own re-registration, e.g. in its new role).

Alive is not the same as keeping up. A worker whose heartbeats report it behind
(its gRPC process's event loop more than ``busy_lag_s``, or its engine's last load report
older than ``busy_engine_s``) is
*busy*: listed, usable for health, keeping its requests, but not picked for new ones
(``placeable``); it is dropped only when its heartbeats stop. And heartbeat age is judged
against the router's own loop: the router's sweep ticks (``tick``) measure how late the
loop ran them, and a stall credits every worker its length, since heartbeats that arrived
during it could not be processed. Between ticks, the stall in progress (the next tick
overdue) is credited the same way (``_expired``), so a heartbeat or a placement handled
right after a stall, before the tick, does not find its worker expired either.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from pdserve.v1 import common_pb2

PRODUCER = common_pb2.ROLE_PRODUCER
CONSUMER = common_pb2.ROLE_CONSUMER
COLOCATED = common_pb2.ROLE_COLOCATED
ROLE_NAMES = {PRODUCER: "producer", CONSUMER: "consumer", COLOCATED: "colocated"}


class RegistrationError(Exception):
    """A Register call refused; the message starts with the offending field."""

    def __init__(self, message: str, *, precondition: bool = False) -> None:
        super().__init__(message)
        # True: the request is well formed but conflicts with the cluster (fingerprint,
        # model); False: the request itself is malformed.
        self.precondition = precondition


def busy_reason(load: common_pb2.WorkerLoad, loop_s: float, engine_s: float) -> str:
    """Why a worker reporting ``load`` is behind: its event loop by more than ``loop_s``, or
    its engine's last report older than ``engine_s`` ("" if neither; 0: that check is off).
    Also what deploy/cluster.py's start-up waits out."""
    if loop_s and load.loop_lag_s > loop_s:
        return f"its event loop is {load.loop_lag_s:.1f} s behind (--busy-lag {loop_s:g} s)"
    if engine_s and load.engine_report_age_s > engine_s:
        return (f"its engine's last load report is {load.engine_report_age_s:.1f} s old "
                f"(--busy-engine-age {engine_s:g} s)")
    return ""


@dataclass(eq=False)  # identity: a re-registered worker is a new incarnation
class WorkerInfo:
    worker_id: str
    role: int  # common_pb2.Role
    address: str  # gRPC address the router dials
    kv_address: str  # consumers: where producers push KV
    model: str
    kv_fingerprint: str
    max_model_len: int
    load: common_pb2.WorkerLoad
    last_heartbeat: float  # monotonic seconds
    inflight: int = 0  # requests the router has dispatched to it and not yet finished
    dispatched: int = 0  # total dispatched to it, for status and tests
    version: str = ""  # pdserve version it runs (from Register)
    # its Outputs stream over plain TCP, host:port (from Register; "": read the Outputs RPC)
    outputs_address: str = ""
    # the same on its abstract Unix socket, "@name" (from Register; "": none). Read first:
    # it is reachable only when this router shares the worker's host and network namespace.
    outputs_unix: str = ""
    tp_size: int = 1  # tensor-parallel ranks (a consumer's ranks take a producer's heads)
    dp_size: int = 1  # attention data-parallel groups among those ranks (divides tp_size)
    # Prefix caching (from Register): block size in tokens (0: a worker older than the
    # KV index; it gets no reuse_cached and no cache-aware placement), cache on, salt kept.
    block_size: int = 0
    prefix_caching: bool = False
    accepts_cache_salt: bool = False
    # requests sent to each attention data-parallel group since the last heartbeat
    # (router/control/dp_placement.py)
    dp_sent: list[int] = field(default_factory=list)
    draining: bool = False  # takes no new requests (deregistered, or changing role)
    drain_reason: str = ""
    target_role: int = 0  # a role change the router ordered (0: none)
    # Deregister(done): the worker drained and is exiting. Forgotten once no request the
    # router placed on it is still running here (its last messages may trail the call).
    left: bool = False
    # Which registration this is: rises with every Register of any worker in this registry,
    # so a restart at the same id and address is told apart from the process it replaced.
    incarnation: int = 0

    @property
    def role_name(self) -> str:
        return ROLE_NAMES.get(self.role, "unknown")

    @property
    def unhealthy_reason(self) -> str:
        if self.load.kv_exhausted_by_orphans:
            return "KV pool exhausted by orphaned requests"
        return ""

    @property
    def healthy(self) -> bool:
        return not self.unhealthy_reason

    def busy_reason(self, loop_s: float, engine_s: float) -> str:
        """Why the worker is behind (busy_reason of its last load report)."""
        return busy_reason(self.load, loop_s, engine_s)


class Registry:
    def __init__(self, *, heartbeat_timeout_s: float, served_model: str | None = None,
                 clock: Callable[[], float] = time.monotonic, busy_lag_s: float = 0.0,
                 busy_engine_s: float = 0.0) -> None:
        self.heartbeat_timeout_s = heartbeat_timeout_s
        # a worker this far behind gets no new requests (router/config.py; 0: off)
        self.busy_lag_s = busy_lag_s
        self.busy_engine_s = busy_engine_s
        self.served_model = served_model  # display name workers must serve; None: any
        self._clock = clock
        self._workers: dict[str, WorkerInfo] = {}
        self._incarnations = itertools.count(1)
        # Called with (worker, reason) after a worker leaves (dropped or replaced).
        self.on_drop: list[Callable[[WorkerInfo, str], None]] = []
        # Called after any change that may flip cluster health.
        self.on_change: list[Callable[[], None]] = []
        # While a role change runs, a cluster that cannot serve for a moment (the only pair
        # is being rebuilt) is expected back: new requests wait until this clock time for a
        # usable worker instead of being refused (router/requests/health.py wait_until_serving).
        self.hold_until = 0.0
        self.held = 0  # requests waiting on hold_until now
        # The router loop's liveness ticks (``tick``): the last one, its period (0: none yet),
        # how late the last one ran, and every lateness credited to the workers so far.
        self._ticked = 0.0
        self._tick_period = 0.0
        self.loop_lag_s = 0.0
        self.stall_credit_s = 0.0

    def clock(self) -> float:
        return self._clock()

    # -- writes ----------------------------------------------------------------------------

    def register(self, *, worker_id: str, role: int, address: str, kv_address: str = "",
                 model: str = "", kv_fingerprint: str = "", max_model_len: int = 0,
                 load: common_pb2.WorkerLoad | None = None, version: str = "",
                 tp_size: int = 1, block_size: int = 0, prefix_caching: bool = False,
                 accepts_cache_salt: bool = False, dp_size: int = 1,
                 outputs_address: str = "", outputs_unix: str = "") -> WorkerInfo:
        if not worker_id:
            raise RegistrationError("worker_id: must not be empty")
        if role not in ROLE_NAMES:
            raise RegistrationError(f"role: must be producer, consumer or colocated, got {role}")
        if not address:
            raise RegistrationError("address: must not be empty")
        if role == CONSUMER and not kv_address:
            raise RegistrationError("kv_address: a consumer must advertise its KV address")
        if not 1 <= tp_size <= 256:
            raise RegistrationError(f"tp_size: must be in [1, 256], got {tp_size}")
        if dp_size < 1 or tp_size % dp_size:
            raise RegistrationError(f"dp_size: must divide tp_size {tp_size}, got {dp_size}")
        if outputs_address:
            _check_host_port("outputs_address", outputs_address)
        if outputs_unix:
            _check_abstract_name("outputs_unix", outputs_unix)
        if max_model_len < 1:
            raise RegistrationError(f"max_model_len: must be >= 1, got {max_model_len}")
        if not 0 <= block_size <= 1 << 16:
            raise RegistrationError(f"block_size: must be in [0, 65536], got {block_size}")
        if self.served_model is not None and model != self.served_model:
            raise RegistrationError(
                f"model: worker {worker_id} serves {model!r} but this router serves "
                f"{self.served_model!r}", precondition=True)
        if role in (PRODUCER, CONSUMER):
            # Colocated workers never move KV, so only the P/D pools must agree on layout.
            for w in self._workers.values():
                if w.worker_id != worker_id and w.role in (PRODUCER, CONSUMER) \
                        and w.kv_fingerprint != kv_fingerprint:
                    raise RegistrationError(
                        f"kv_fingerprint: {ROLE_NAMES[role]} {worker_id} has "
                        f"{kv_fingerprint!r} but {w.role_name} {w.worker_id} has "
                        f"{w.kv_fingerprint!r}; producers and consumers must share the KV "
                        f"layout (model, dtype, block size, --kv-cache-dtype and its "
                        f"scales)", precondition=True)
        old = self._workers.get(worker_id)
        info = WorkerInfo(worker_id=worker_id, role=role, address=address, kv_address=kv_address,
                          model=model, kv_fingerprint=kv_fingerprint,
                          max_model_len=max_model_len, load=_copy_load(load),
                          last_heartbeat=self._clock(), version=version, tp_size=tp_size,
                          dp_size=dp_size,
                          block_size=block_size, prefix_caching=prefix_caching,
                          accepts_cache_salt=accepts_cache_salt,
                          outputs_address=outputs_address, outputs_unix=outputs_unix,
                          incarnation=next(self._incarnations))
        self._workers[worker_id] = info
        if old is not None:
            # A restart under the same id: requests on the old incarnation are gone with it.
            info.dispatched = old.dispatched
            why = (f"worker {worker_id} rebuilt as {ROLE_NAMES[role]} (a planned role change)"
                   if old.target_role else f"worker {worker_id} re-registered")
            self._notify_drop(old, why)
        self._notify_change()
        return info

    def heartbeat(self, worker_id: str, load: common_pb2.WorkerLoad | None) -> bool:
        """False when the worker is unknown (dropped): it must register again."""
        w = self._workers.get(worker_id)
        if w is None or self._expired(w, self._clock()):
            return False
        was_healthy = w.healthy
        w.load = _copy_load(load)
        w.dp_sent = []  # the new load counts what was sent before it
        w.last_heartbeat = self._clock()
        if w.healthy != was_healthy:
            self._notify_change()
        return True

    def tick(self, period_s: float) -> float:
        """The router's loop ran its liveness tick, meant every ``period_s``. Returns how late
        it ran and credits every worker that much heartbeat age: a loop that stalled for 4 s
        processed no heartbeat in that time, and silence it caused is no worker's."""
        now = self._clock()
        late = max(0.0, now - self._ticked - self._tick_period) if self._tick_period else 0.0
        self._ticked, self._tick_period = now, period_s
        self.loop_lag_s = late
        if late > 0:
            self.stall_credit_s += late
            for w in self._workers.values():
                w.last_heartbeat = min(now, w.last_heartbeat + late)
        return late

    def sweep(self) -> list[WorkerInfo]:
        """Drops every worker whose last heartbeat is older than the timeout, and every
        worker that left (Deregister done) once the router's requests on it ended."""
        now = self._clock()
        dropped = [w for w in self._workers.values() if self._expired(w, now)]
        for w in dropped:
            del self._workers[w.worker_id]
            self._notify_drop(w, f"worker {w.worker_id} ({w.role_name} at {w.address}) "
                                 f"{self.silence_reason(w)}")
        for w in [w for w in self._workers.values() if w.left and w.inflight <= 0]:
            self.remove(w.worker_id, f"worker {w.worker_id} deregistered ({w.drain_reason})")
        if dropped:
            self._notify_change()
        return dropped

    def silence_reason(self, w: WorkerInfo) -> str:
        """Why a silent worker is dropped. One that already left (Deregister done) and then
        went quiet with requests still open here is not a lost worker: it said goodbye, and
        the requests' last messages never came."""
        if w.left:
            return (f"left ({w.drain_reason}) and went silent with {w.inflight} "
                    f"request(s) still open here")
        return f"stopped heartbeating ({self.heartbeat_timeout_s:g} s)"

    def drain(self, worker_id: str, reason: str) -> bool:
        """Stops placing new requests on the worker; those it runs go on. False: unknown."""
        w = self._workers.get(worker_id)
        if w is None:
            return False
        if not w.draining:
            w.draining, w.drain_reason = True, reason
            self._notify_change()
        return True

    def leave(self, worker_id: str, reason: str) -> bool:
        """The worker is gone once the router's last request on it ends (at once if none:
        a drained worker's final stream messages can still be on their way here, and
        dropping it first would fail those requests). False: unknown."""
        w = self._workers.get(worker_id)
        if w is None:
            return False
        self.drain(worker_id, reason)
        w.left = True
        if w.inflight <= 0:
            self.remove(worker_id, reason)
        return True

    def order_role_change(self, worker_id: str, role: int) -> WorkerInfo:
        """Drains the worker and records the role it must come back in (``orders``)."""
        if role not in ROLE_NAMES:
            raise RegistrationError(f"role: must be producer, consumer or colocated, got {role}")
        w = self._workers.get(worker_id)
        if w is None:
            raise RegistrationError(f"worker_id: {worker_id!r} is not registered")
        w.target_role = role
        self.drain(worker_id, f"changing role to {ROLE_NAMES[role]}")
        return w

    def orders(self, worker_id: str) -> int:
        """The role the router wants this worker to move to (0: none)."""
        w = self._workers.get(worker_id)
        return w.target_role if w is not None else 0

    def remove(self, worker_id: str, reason: str) -> None:
        w = self._workers.pop(worker_id, None)
        if w is not None:
            self._notify_drop(w, reason)
            self._notify_change()

    # -- reads -----------------------------------------------------------------------------

    def get(self, worker_id: str) -> WorkerInfo | None:
        return self._workers.get(worker_id)

    def all(self) -> list[WorkerInfo]:
        return list(self._workers.values())

    def usable(self, role: int) -> list[WorkerInfo]:
        """Workers of ``role`` that may take a new request: heartbeating, healthy and not
        draining (the one place placement learns a worker is leaving)."""
        now = self._clock()
        return [w for w in self._workers.values()
                if w.role == role and w.healthy and not w.draining and not self._expired(w, now)]

    def placeable(self, role: int) -> list[WorkerInfo]:
        """Usable workers that keep up: where new requests go (busy ones keep theirs)."""
        return [w for w in self.usable(role) if not self.busy_reason(w)]

    def busy(self) -> list[WorkerInfo]:
        """Usable workers that are behind, by worker id."""
        return sorted((w for r in ROLE_NAMES for w in self.usable(r)
                       if self.busy_reason(w)), key=lambda w: w.worker_id)

    def busy_reason(self, w: WorkerInfo) -> str:
        """Why ``w`` is busy under this router's bounds ("" when it keeps up)."""
        return w.busy_reason(self.busy_lag_s, self.busy_engine_s)

    def serving(self) -> bool:
        """A request can be placed: a producer with a consumer, or a colocated worker."""
        return bool(self.usable(COLOCATED)) or (
            bool(self.usable(PRODUCER)) and bool(self.usable(CONSUMER)))

    def max_model_len(self) -> int:
        """The longest sequence every usable worker accepts (0 when none is usable)."""
        lens = [w.max_model_len for r in ROLE_NAMES for w in self.usable(r)]
        return min(lens) if lens else 0

    def heartbeat_age(self, w: WorkerInfo) -> float:
        return max(0.0, self._clock() - w.last_heartbeat)

    # -- internals -------------------------------------------------------------------------

    def _expired(self, w: WorkerInfo, now: float) -> bool:
        return now - w.last_heartbeat - self._stalled(now) > self.heartbeat_timeout_s

    def _stalled(self, now: float) -> float:
        """How long the loop has been stalled now: the time past an overdue tick (the tick
        credits it once it runs)."""
        if not self._tick_period:
            return 0.0
        return max(0.0, now - self._ticked - self._tick_period)

    def _notify_drop(self, w: WorkerInfo, reason: str) -> None:
        for cb in list(self.on_drop):
            cb(w, reason)

    def _notify_change(self) -> None:
        for cb in list(self.on_change):
            cb()


def _copy_load(load: common_pb2.WorkerLoad | None) -> common_pb2.WorkerLoad:
    out = common_pb2.WorkerLoad()
    if load is not None:
        out.CopyFrom(load)
    return out


# Linux's sockaddr_un holds 108 bytes of path: the NUL byte (written "@") and 107 of name.
_MAX_UNIX_NAME = 108


def _check_abstract_name(field_name: str, value: str) -> None:
    """``value`` is an abstract Unix socket name, "@" then printable ASCII without spaces (it
    is logged and shown by doctor, and fits sockaddr_un)."""
    name = value[1:]
    if not value.startswith("@") or not name or len(value) > _MAX_UNIX_NAME \
            or not all("!" <= ch <= "~" for ch in name):
        raise RegistrationError(f"{field_name}: must be '@' and up to {_MAX_UNIX_NAME - 1} "
                                f"printable characters, got {value!r}")


def _check_host_port(field_name: str, value: str) -> None:
    """``value`` is host:port (an IPv6 host in brackets) with a port in [1, 65535]."""
    host, sep, port = value.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise RegistrationError(f"{field_name}: must be host:port, got {value!r}")
