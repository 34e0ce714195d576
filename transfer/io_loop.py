"""The background I/O thread behind a network sender or receiver.

Callers on any thread hand closures to ``call`` (fire and forget) or ``call_sync`` (waits
for the result); only this thread touches ZMQ sockets, the data plane and the records, so
the records need no lock beyond the one guarding the poll queue. A pipe wakes the loop
out of its ZMQ poll as soon as a call is queued.
"""

from __future__ import annotations

import ctypes
import os
import queue
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import zmq

from transfer.types import TransferUpdate

BUSY_POLL_MS = 1  # loop period while data-plane ops are in flight (completion latency)
IDLE_POLL_MS = 50  # loop period otherwise (deadline / heartbeat granularity)
# Longest sleep of a loop that says when its next timer is due (``idle_poll_ms``): every
# wakeup takes the GIL from the engine thread sharing the process, so a side with no
# transfer open sleeps until its next heartbeat instead of waking 20 times a second.
MAX_IDLE_POLL_MS = 1000


class IOLoop:
    def __init__(self, name: str) -> None:
        self.zctx = zmq.Context()
        self.poller = zmq.Poller()
        self._calls: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._rfd, self._wfd = os.pipe()
        os.set_blocking(self._rfd, False)
        self.poller.register(self._rfd, zmq.POLLIN)
        self._updates: list[TransferUpdate] = []
        self._lock = threading.Lock()
        self._stop = False
        self.error: BaseException | None = None  # a crash of the loop, re-raised to callers
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def start(self) -> None:
        self._thread.start()

    # ---- caller side -------------------------------------------------------------
    def call(self, fn: Callable[[], None]) -> None:
        if self.error is not None:
            raise RuntimeError(f"transfer I/O thread died: {self.error!r}") from self.error
        self._calls.put(fn)
        self.wake()

    def wake(self) -> None:
        """Ends the loop's current poll early (any thread)."""
        try:
            os.write(self._wfd, b"x")
        except (BlockingIOError, OSError):  # a full pipe already wakes it; a closed one: stopped
            pass

    def call_sync(self, fn: Callable[[], Any], timeout: float) -> Any:
        fut: Future[Any] = Future()

        def run() -> None:
            try:
                fut.set_result(fn())
            except BaseException as e:  # handed to the caller, not swallowed
                fut.set_exception(e)

        self.call(run)
        return fut.result(timeout)

    def take_updates(self) -> list[TransferUpdate]:
        with self._lock:
            out, self._updates = self._updates, []
        return out

    def stop(self, timeout: float = 10.0) -> None:
        """Ends the loop and frees its sockets; safe after the loop crashed. The context
        is destroyed on every path: one left open keeps its sockets, their ports and
        libzmq's threads for the rest of the process."""
        if self._thread.is_alive():
            # not call(): that refuses once the loop has failed, and a failed loop can still
            # be alive, releasing its plane in on_stop
            self._calls.put(self._set_stop)
            self.wake()
            self._thread.join(timeout)
        if self._wfd < 0:
            return
        os.close(self._rfd)
        os.close(self._wfd)
        self._rfd = self._wfd = -1
        self.zctx.destroy(linger=0)

    # ---- loop side ---------------------------------------------------------------
    def report(self, u: TransferUpdate) -> None:
        with self._lock:
            self._updates.append(u)

    def _set_stop(self) -> None:
        self._stop = True

    def _run(self) -> None:
        name_os_thread(f"{self._thread.name}-io")
        try:
            self.on_start()
            while not self._stop:
                busy = self.busy()
                wait = BUSY_POLL_MS if busy else self.idle_poll_ms(time.monotonic())
                events = dict(self.poller.poll(wait))
                if self._rfd in events:
                    try:
                        os.read(self._rfd, 4096)
                    except BlockingIOError:
                        pass
                self.run_calls()
                for sock in [s for s in events if s is not self._rfd]:
                    self.on_readable(sock)
                self.tick(time.monotonic())
                self.end_turn()
        except BaseException as e:  # keep the traceback for callers; never die silently
            self.error = e
            raise
        finally:
            self.on_stop()

    def run_calls(self) -> None:
        """Runs the calls queued so far (loop thread). ``on_readable`` runs them again after
        each receive: a call queued before a peer's message was sent (an ``expect()`` before
        the push it allows) must take effect before that message is handled, even when the
        message lands after this turn's first drain."""
        while not self._calls.empty():
            self._calls.get()()

    # ---- hooks -------------------------------------------------------------------
    def on_start(self) -> None:
        """Creates sockets and the data plane on the loop thread."""

    def busy(self) -> bool:
        return False

    def idle_poll_ms(self, now: float) -> int:
        """How long the loop may sleep when not ``busy`` (a call or a message wakes it
        sooner): until the earliest timer ``tick`` has to act on."""
        return IDLE_POLL_MS

    def on_readable(self, sock: Any) -> None:
        """Reads every message waiting on ``sock``."""

    def tick(self, now: float) -> None:
        """Progress ops, deadlines, heartbeats."""

    def end_turn(self) -> None:
        """Sends what the turn queued (one message per peer, however many it holds)."""

    def on_stop(self) -> None:
        """Releases everything."""


def name_os_thread(name: str) -> None:
    """Gives the calling thread an OS name (``top -H``, ``/proc/*/task/*/comm``, py-spy):
    Python 3.11 leaves every thread named after the process, so an engine process's
    transfer threads could not be told apart from its engine loop when one of them ate CPU."""
    if sys.platform != "linux":
        return
    PR_SET_NAME = 15  # noqa: N806 - the kernel's name
    try:
        ctypes.CDLL(None).prctl(PR_SET_NAME, name.encode()[:15], 0, 0, 0)
    except (OSError, AttributeError):  # a naming failure must never stop a thread
        pass
