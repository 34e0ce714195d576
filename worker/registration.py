"""Joining the router: Register once the engine is ready, then heartbeat the load; register
again if the router forgot us (it restarted, or dropped us after missed heartbeats). Each
heartbeat's answer carries the router's orders (a role change it wants). Leaving: Deregister
(draining: no new work comes) and, once drained, Deregister(done). A worker whose engine
failed leaves at once (Deregister(done)) and never registers again: it serves nothing until
it restarts, and between the failure and its exit (the engine stops its TP ranks and
transfer endpoints first) the router would otherwise place new requests on it.

Liveness travels apart from the data plane: Register and the heartbeats leave from the
worker's heartbeat process (worker/heartbeat_process.py: why a process, not a thread), so
nothing that loads this gRPC process (an event loop saturated by token streams, a starved
CPU share) can delay them past the router's timeout; the router would take a busy worker
for a dead one and fail all its requests. This process's loop posts on a shared board what
the heartbeats say (``LoopWatch``, worker/loop_watch.py): the engine's latest load and how
far behind the loop runs, and the router stops placing new requests on a worker that is
behind (busy) without dropping it. Lifecycle: ``run()`` starts the ticker and the heartbeat
process, ends them when it is cancelled, and raises when the router refuses the worker or
the process fails; ``close()`` waits for the process to end. What the router sends back for
the loop (a role-change order) arrives over the process's pipe, read on the loop.
Deregister is this process's own call (``deregister``): a drain waits for its answer."""

from __future__ import annotations

import asyncio
import contextlib
import importlib.metadata
import logging
import multiprocessing as mp
from collections.abc import Callable
from typing import Any

from pdserve.v1 import common_pb2, router_pb2_grpc, worker_pb2

from worker.heartbeat_process import (
    CALL_TIMEOUT_S,
    HeartbeatSpec,
    deregister,
    heartbeat_main,
    router_channel,
)
from worker.load_board import LoadBoard, new_raw
from worker.load_report import LoadReport
from worker.loop_watch import LoopWatch
from worker.messages import ReadyInfo

log = logging.getLogger("pdserve.worker")
ROLES = {"producer": common_pb2.ROLE_PRODUCER, "consumer": common_pb2.ROLE_CONSUMER,
         "colocated": common_pb2.ROLE_COLOCATED}


def pdserve_version() -> str:
    try:
        return importlib.metadata.version("pdserve")
    except importlib.metadata.PackageNotFoundError:  # run from a source tree
        return "unknown"


class Registration:
    def __init__(self, router: str, worker_id: str, role: str, address: str,
                 info: ReadyInfo, load: Callable[[], LoadReport | None],
                 cluster_token: str = "", router_ca: str = "",
                 failed: Callable[[], str | None] = lambda: None,
                 outputs_address: str = "", outputs_unix: str = "") -> None:
        self.router, self.router_ca = router, router_ca
        self.outputs_address = outputs_address  # the plain-TCP Outputs stream ("": none)
        self.outputs_unix = outputs_unix  # the same on an abstract Unix socket ("": none)
        self.channel = router_channel(router, router_ca)  # Deregister's
        self.membership = router_pb2_grpc.MembershipStub(self.channel)
        self.worker_id = worker_id
        self.role = role
        self.address = address
        self.info = info
        self.token = cluster_token
        self.change_role = 0  # common_pb2.Role the router ordered (0: none)
        self.ordered = asyncio.Event()  # set when change_role is
        self.failed = failed  # why the engine failed (None while it serves)
        self._ctx = mp.get_context("spawn")
        self.watch = LoopWatch(load, board=LoadBoard(new_raw(self._ctx)),
                               on_tick=self._check_failed)
        self._draining = False
        self._told_failed = False
        self._proc: Any = None  # the heartbeat process (a spawn context's Process)
        self._conn: Any = None  # our end of its pipe
        self._reading: tuple[asyncio.AbstractEventLoop, int] | None = None  # its reader

    @property
    def draining(self) -> bool:
        """Set once deregistered: never register again."""
        return self._draining

    @draining.setter
    def draining(self, value: bool) -> None:
        if value and not self._draining:
            self._send(("draining",))
        self._draining = value

    def _register_request(self) -> bytes:
        i = self.info
        return worker_pb2.RegisterRequest(
            worker_id=self.worker_id, role=ROLES[self.role], address=self.address,
            kv_address=i.kv_address, model=i.model, kv_fingerprint=i.kv_fingerprint,
            max_model_len=i.max_model_len, cluster_token=self.token, tp_size=i.tp_size,
            dp_size=i.dp_size, lease_s=i.lease_s, block_size=i.block_size,
            prefix_caching=i.prefix_caching, accepts_cache_salt=i.accepts_cache_salt,
            version=pdserve_version(), outputs_address=self.outputs_address,
            outputs_unix=self.outputs_unix).SerializeToString()

    async def run(self) -> None:
        """Registers (retrying while the router is not up) and heartbeats until cancelled;
        raises RuntimeError if the router refuses this worker or the heartbeat process
        fails."""
        loop = asyncio.get_running_loop()
        refused: asyncio.Future[None] = loop.create_future()
        ours, theirs = self._ctx.Pipe()
        spec = HeartbeatSpec(self.router, self.router_ca, self.worker_id, self.role,
                             self.token, self._register_request())
        # started from the loop's thread: the child's parent-death signal follows the thread
        # that started it (worker/parent_death.py), and the loop's lives as long as the worker
        self._proc = self._ctx.Process(target=heartbeat_main, args=(spec, self.watch.board.raw,
                                                                    theirs),
                                       daemon=True, name=f"{self.worker_id}-heartbeat")
        self._proc.start()
        theirs.close()
        self._conn = ours
        if self._draining:
            self._send(("draining",))
        self._told_failed = False
        self._check_failed()
        loop.add_reader(ours.fileno(), self._on_message, refused)
        self._reading = (loop, ours.fileno())
        ticker = asyncio.create_task(self.watch.run())
        try:
            await refused
        finally:
            ticker.cancel()
            self._end()

    def _on_message(self, refused: asyncio.Future[None]) -> None:
        conn = self._conn
        try:
            while conn is not None and conn.poll():
                msg = conn.recv()
                if msg[0] == "order":
                    self.change_role = int(msg[1])
                    self.ordered.set()
                elif msg[0] == "refused":
                    _fail(refused, f"the router refused this worker: {msg[1]}")
                elif msg[0] == "error":
                    _fail(refused, f"the heartbeat process failed: {msg[1]}")
        except (EOFError, OSError):  # it exited: a worker nobody hears must not go on
            self._unwatch()
            code = self._proc.exitcode if self._proc is not None else None
            _fail(refused, f"the heartbeat process exited (exit code {code})")

    def _check_failed(self) -> None:
        """On each tick: an engine that failed makes the heartbeat process leave the router
        (once)."""
        if not self._told_failed and (why := self.failed()) is not None:
            self._told_failed = True
            self._draining = True
            self._send(("failed", why))

    def _send(self, msg: tuple[Any, ...]) -> None:
        if self._conn is not None:
            with contextlib.suppress(OSError, ValueError):  # it ended already
                self._conn.send(msg)

    def _unwatch(self) -> None:
        # By the number taken when it was added, and before the pipe closes: a closed
        # Connection has no fileno() to remove by, and a reader left on a closed fd number
        # is inherited by the next socket to get that number (a role change's new listener
        # then failed with EEXIST from the selector).
        if self._reading is not None:
            loop, fd = self._reading
            self._reading = None
            loop.remove_reader(fd)

    def _end(self) -> None:
        """Tells the heartbeat process to stop (no more beats after run() ends)."""
        self._unwatch()
        if self._conn is not None:
            self._send(("stop",))
            self._conn.close()
            self._conn = None

    async def deregister(self, reason: str, done: bool = False, timeout: float = 5.0) -> bool:
        """Tells the router to stop sending work (done: to forget this worker). False when
        the router could not be told (gone, or did not know us): nothing to wait for then."""
        self.draining = True
        return await asyncio.to_thread(deregister, self.membership, self.worker_id,
                                       self.token, reason, done, timeout)

    async def close(self) -> None:
        self._end()
        self.channel.close()
        proc = self._proc
        if proc is not None:
            # it ends at its next wait, after a call in flight (at most CALL_TIMEOUT_S)
            await asyncio.to_thread(proc.join, CALL_TIMEOUT_S)
            if proc.is_alive():
                proc.kill()
                await asyncio.to_thread(proc.join, 5.0)


def _fail(fut: asyncio.Future[None], why: str) -> None:
    if not fut.done():
        fut.set_exception(RuntimeError(why))
