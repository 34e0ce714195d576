"""Vets a peer's data-plane info in a child process before this process's UCX/NIXL parses it.

Why: UCX unpacks a peer's worker address with assertions, so a malformed address (from a
stranger on a port without a cluster token, or a broken peer) aborts the whole process,
not just a call. The child opens an endpoint / registers the remote agent exactly as the
plane would; if it survives, the bytes are safe to use here (same library, same host
settings). One long-lived child per side answers in about a millisecond; a crash costs
only the child, which the next vet restarts.

The child runs ``serve``: length-prefixed infos on stdin, one line per answer.
"""

from __future__ import annotations

import atexit
import os
import select
import struct
import subprocess
import sys
import threading
import time
from typing import Any

from transfer.types import TransferError

START_S = 30.0  # a fresh child imports UCX/NIXL before it answers (seconds on a busy host)
ANSWER_S = 5.0  # one vet of a live child


class PlaneProbe:
    """Thread-safe; ``vet`` blocks its caller (never the I/O thread: NetSide runs it on a
    helper thread)."""

    def __init__(self, backend: str) -> None:
        self._backend = backend
        self._proc: subprocess.Popen[bytes] | None = None
        self._lock = threading.Lock()
        self._closed = False

    def warm(self) -> None:
        """Starts the child now (without waiting for it), so the first vet is quick."""
        with self._lock:
            if not self._closed and (self._proc is None or self._proc.poll() is not None):
                self._start()

    def vet(self, info: bytes) -> None:
        with self._lock:
            if self._closed:
                raise TransferError("plane probe closed")
            fresh = self._proc is None or self._proc.poll() is not None
            if fresh:
                self._start()
            proc = self._proc
            assert proc is not None and proc.stdin is not None and proc.stdout is not None
            try:
                proc.stdin.write(struct.pack("<I", len(info)) + info)
                proc.stdin.flush()
                line = _readline(proc.stdout, START_S if fresh else ANSWER_S)
            except (OSError, TimeoutError) as e:
                self._kill()
                raise TransferError(f"probe failed ({e})") from None
            if not line:  # the child died on these bytes: they would have killed us
                rc = proc.wait(5)
                self._proc = None
                raise TransferError(f"malformed (it crashed a probe "
                                    f"process, exit {rc})")
            if line != b"ok\n":
                raise TransferError(f"{line.decode(errors='replace')[3:].strip()}")

    def _start(self) -> None:
        env = {**os.environ, "UCX_WARN_UNUSED_ENV_VARS": "n", "UCX_LOG_LEVEL": "fatal"}
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        code = (f"import sys; sys.path.insert(0, {root!r}); "
                "from transfer.plane_probe import serve; serve(sys.argv[1])")
        self._proc = subprocess.Popen([sys.executable, "-c", code, self._backend],
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                      stderr=subprocess.DEVNULL, env=env)

    def _kill(self) -> None:
        if self._proc is not None:
            self._proc.kill()
            self._proc.wait(5)
            self._proc = None

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._kill()


_PROBES: dict[str, PlaneProbe] = {}
_PROBES_LOCK = threading.Lock()


def shared(backend: str) -> PlaneProbe:
    """One child per backend per process, shared by every sender and receiver in it and
    started once (a start costs about a second of imports). It ends with this process:
    at exit, or when its stdin closes because this process died."""
    with _PROBES_LOCK:
        if backend not in _PROBES:
            _PROBES[backend] = PlaneProbe(backend)
            if len(_PROBES) == 1:
                atexit.register(close_all)
        return _PROBES[backend]


def close_all() -> None:
    with _PROBES_LOCK:
        probes = list(_PROBES.values())
        _PROBES.clear()
    for p in probes:
        p.close()


def _readline(f: Any, timeout: float) -> bytes:
    end = time.monotonic() + timeout
    buf = b""
    fd = f.fileno()
    while not buf.endswith(b"\n"):
        left = end - time.monotonic()
        if left <= 0 or not select.select([fd], [], [], left)[0]:
            raise TimeoutError(f"no answer in {timeout} s")
        chunk = os.read(fd, 4096)
        if not chunk:
            return b""
        buf += chunk
    return buf


def serve(backend: str) -> None:
    """The child's loop."""
    stdin, stdout = sys.stdin.buffer, sys.stdout.buffer
    assert backend == "ucx", backend
    import ucxx._lib.libucxx as ucx

    worker = ucx.UCXWorker(ucx.UCXContext(feature_flags=(ucx.Feature.TAG,)))

    def check(info: bytes) -> None:
        addr = ucx.UCXAddress.create_from_buffer(info)
        ucx.UCXEndpoint.create_from_worker_address(worker, addr, False).close()

    while len(head := stdin.read(4)) == 4:
        info = stdin.read(struct.unpack("<I", head)[0])
        try:
            check(info)
            stdout.write(b"ok\n")
        except Exception as e:
            stdout.write(f"no {type(e).__name__}: {e}".replace("\n", " ").encode()[:500] + b"\n")
        stdout.flush()

