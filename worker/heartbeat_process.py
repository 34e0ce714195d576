"""The worker's heartbeat process: Register, then a heartbeat every interval, apart from
everything the worker's gRPC process does.

Why a process: the heartbeats used to leave from a thread of the gRPC process. A thread
shares that process's GIL and its CPU share; when the process was starved (its event loop
saturated by token streams, or, in the overload test, held to ~1% of a CPU), each wake-up
of the thread waited for the loop thread to be scheduled and hand over the GIL, several
times a heartbeat: a heartbeat that should take milliseconds took 1-3 s, against the
router's 3 s timeout, and the router dropped a busy worker as dead and failed its requests
(seen in CI on a slowed host). Here a heartbeat needs only this process to be scheduled.

What it says comes from the board the gRPC process's loop writes (worker/load_board.py):
the engine's latest load and how far behind the loop runs. A worker whose loop is stuck
therefore reads as busy (the router stops placing on it), not as dead; a worker that is
stopped (SIGSTOP to its process group) or killed stops heartbeating, as it should: this
process dies with its parent (``die_with_parent``) and stops with its process group.

Talk with the gRPC process (``Registration``, worker/registration.py) goes over a pipe, one
small tuple a message:
  to here:   ("draining",)   no registering again (the router is told by the worker itself)
             ("failed", why) the engine failed: leave the router for good, beat no more
             ("stop",)       end (so does the pipe's end: the parent is gone)
  from here: ("order", role) a role change the router ordered (once)
             ("refused", details)  the router will not have this worker: the worker exits
             ("error", text) this process failed
"""

from __future__ import annotations

import ctypes
import logging
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any, cast

import grpc
from pdserve.v1 import common_pb2, router_pb2, router_pb2_grpc, worker_pb2, worker_pb2_grpc

from worker.load_board import LoadBoard
from worker.parent_death import die_with_parent

log = logging.getLogger("pdserve.worker")
# Router calls from here. Shorter than the router's heartbeat timeout (3 s by default) would
# only fail calls to a router that is itself stalled; longer would delay a re-registration
# after one.
CALL_TIMEOUT_S = 5.0
# Answers that mean "this worker may not join" (a retry cannot change them).
REFUSED = (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.INVALID_ARGUMENT,
           grpc.StatusCode.FAILED_PRECONDITION)
ROLE_VALUES = (common_pb2.ROLE_PRODUCER, common_pb2.ROLE_CONSUMER, common_pb2.ROLE_COLOCATED)
# The process's name (/proc/PID/comm, 15 bytes at most): a spawned child's command line is
# multiprocessing's and names no target, so this is how ps, top and the serving bench's CPU
# meter (deploy/benchmark/proc_cpu.py) tell it from the engine process.
PROCESS_NAME = b"pdserve-hbeat"


@dataclass(frozen=True)
class HeartbeatSpec:
    """What the process needs, picklable for the spawn."""

    router: str
    router_ca: str  # a CA file when the router serves TLS; "" for plain
    worker_id: str
    role: str
    cluster_token: str
    register: bytes  # the worker's RegisterRequest, serialized, its load left out


def router_channel(router: str, router_ca: str) -> grpc.Channel:
    if router_ca:  # the router serves TLS (--tls-cert): verify it with this CA
        with open(router_ca, "rb") as f:
            creds = grpc.ssl_channel_credentials(root_certificates=f.read())
        return grpc.secure_channel(router, creds)
    return grpc.insecure_channel(router)


def deregister(membership: router_pb2_grpc.MembershipStub, worker_id: str, token: str,
               reason: str, done: bool, timeout: float) -> bool:
    """Tells the router to stop sending work (done: to forget this worker). False when the
    router could not be told (gone, or did not know us)."""
    try:
        resp = membership.Deregister(router_pb2.DeregisterRequest(
            worker_id=worker_id, cluster_token=token, done=done, reason=reason),
            timeout=timeout)
    except grpc.RpcError as e:
        call = cast(grpc.Call, e)
        log.warning("could not deregister from the router (%s): %s", call.code().name,
                    call.details())
        return False
    except ValueError:  # closed channel: the worker is stopping
        return False
    return bool(resp.known)


class Heartbeater:
    """The beat itself, apart from the process around it (tests run it on a thread).

    ``load``: the WorkerLoad to send now; ``tell``: a message to the worker; ``wait(s)``:
    sleeps up to s seconds, handling what the worker sends meanwhile, and says whether to
    stop."""

    def __init__(self, channel: grpc.Channel, spec: HeartbeatSpec,
                 load: Callable[[], common_pb2.WorkerLoad],
                 tell: Callable[[tuple[Any, ...]], None]) -> None:
        self.stub = worker_pb2_grpc.RegistryStub(channel)
        self.membership = router_pb2_grpc.MembershipStub(channel)
        self.spec = spec
        self.load = load
        self.tell = tell
        self.interval = 1.0
        self.draining = False  # no registering again
        self.failed: str | None = None  # why the engine failed (None while it serves)
        self.left = False  # told the router the engine failed (once)
        self._order_seen = False

    def run(self, wait: Callable[[float], bool]) -> None:
        """Beats until ``wait`` says stop or the router refuses this worker."""
        registered = False
        while True:
            # Heartbeats start on a fixed cadence, not an interval after the last one ended:
            # a call that takes long (a router or network under load) must not stretch the
            # router's gaps to interval + call.
            started = time.monotonic()
            if self.failed is not None:
                # No heartbeat (it would keep this worker placeable) and no register (after
                # the router dropped it for its failed requests, that would bring it back as
                # a new registration, which the requests that failed here do not exclude).
                if not self.left:
                    self.left = self.draining = True
                    log.warning("engine failed: leaving the router (%s)", self.failed)
                    deregister(self.membership, self.spec.worker_id, self.spec.cluster_token,
                               f"engine failed: {self.failed}", True, CALL_TIMEOUT_S)
                if wait(self.interval):
                    return
                continue
            try:
                if not registered and not self.draining:
                    self._register()
                    registered = True
                elif registered:
                    resp = self.stub.Heartbeat(worker_pb2.HeartbeatRequest(
                        worker_id=self.spec.worker_id, load=self.load(),
                        cluster_token=self.spec.cluster_token), timeout=CALL_TIMEOUT_S)
                    registered = resp.known
                    if registered and resp.change_role:
                        self._order(int(resp.change_role))
            except grpc.RpcError as e:
                call = cast(grpc.Call, e)
                if call.code() in REFUSED:
                    self.tell(("refused", call.details()))
                    return
                log.warning("router unreachable (%s); retrying", call.code().name)
                registered = False
            # (the interval read now: a registration's answer sets it)
            if wait(max(0.0, started + self.interval - time.monotonic())):
                return

    def _register(self) -> None:
        req = worker_pb2.RegisterRequest.FromString(self.spec.register)
        req.load.CopyFrom(self.load())
        resp = self.stub.Register(req, timeout=10)
        self.interval = resp.heartbeat_interval_s or 1.0
        log.info("registered with the router as %s (%s)", self.spec.worker_id, self.spec.role)

    def _order(self, role: int) -> None:
        """A role change the router ordered, handed to the worker once."""
        if not self._order_seen and role in ROLE_VALUES:
            self._order_seen = True
            self.tell(("order", role))


def board_load(board: LoadBoard) -> common_pb2.WorkerLoad:
    """The heartbeat's WorkerLoad: the engine's report as the loop last posted it, with the
    loop's lag and the report's age."""
    lag, age, raw = board.read()
    out = common_pb2.WorkerLoad.FromString(raw)
    out.loop_lag_s, out.engine_report_age_s = lag, age
    return out


class _Pipe:
    """The worker's end of the talk, as ``Heartbeater`` wants it."""

    def __init__(self, conn: Connection, hb: Heartbeater | None = None) -> None:
        self.conn = conn
        self.hb = hb
        self.gone = False  # the worker ended the talk (stop, or its end closed)

    def tell(self, msg: tuple[Any, ...]) -> None:
        try:
            self.conn.send(msg)
        except OSError:  # the worker is gone: the next wait ends this process
            self.gone = True

    def wait(self, timeout: float) -> bool:
        assert self.hb is not None
        end = time.monotonic() + timeout
        while not self.gone:
            left = end - time.monotonic()
            if not self.conn.poll(max(0.0, left)):
                return False
            try:
                msg = self.conn.recv()
            except (EOFError, OSError):
                self.gone = True
                break
            if msg[0] == "stop":
                self.gone = True
            elif msg[0] == "draining":
                self.hb.draining = True
            elif msg[0] == "failed":
                self.hb.failed = str(msg[1])
                return False  # leave the router now, not at the next beat
        return True


def _name_process() -> None:
    if sys.platform == "linux":
        PR_SET_NAME = 15  # noqa: N806 - the kernel's name
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_NAME, PROCESS_NAME, 0, 0, 0)


def heartbeat_main(spec: HeartbeatSpec, raw: Any, conn: Connection) -> None:
    """Entry point of the spawned heartbeat process."""
    # A SIGTERM to the whole process group (scancel, a launcher's stop) starts the worker's
    # drain, during which the heartbeats must go on: the worker ends this process after.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    die_with_parent()
    _name_process()
    logging.basicConfig(level=logging.INFO, format="[%(name)s] %(message)s")
    board = LoadBoard(raw)
    channel = router_channel(spec.router, spec.router_ca)
    pipe = _Pipe(conn)
    hb = pipe.hb = Heartbeater(channel, spec, lambda: board_load(board), pipe.tell)
    try:
        hb.run(pipe.wait)
    except Exception as e:  # noqa: BLE001 - a silent death would leave the worker unheard
        log.exception("the heartbeat process failed")
        pipe.tell(("error", f"{type(e).__name__}: {e}"))
    finally:
        channel.close()
