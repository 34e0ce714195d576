"""Rank 0's handle on the follower ranks 1..N-1 of a tensor-parallel engine.

Lifecycle of one follower (each a process rank 0 spawns, `python -m
engine.parallel.follower`):

  SPAWNED --Hello--> JOINING (its half of the process group) --(rank 0 joins)-->
  LOADING (its weight shard) --KvStart / KvReady--> CAPTURING (GraphsStart: the decode
  buffers and graphs, with rank 0) --GraphsReady--> FOLLOWING (one StepPlan or, for a
  pure-decode step, one GraphStep per step; KvCopy between them when rank 0 copies a
  request's latent blocks to its group; with a rank side attached, SideMessages in
  between and SideReports back on its channel) --(Stop, or rank 0's channel closes, or
  rank 0's process is gone)--> EXITED

The messages are engine.parallel.messages, one type per direction and kind.

Timeouts: start-up waits at most `start_timeout_s` for each message and fails at once
when a follower exits; every collective is bounded by the group's timeout; a follower
that exits mid-step makes rank 0's next collective or plan write fail, and `failure()`
turns that into one TPRankError naming the dead rank. A failed engine stays failed.
Collectives captured in CUDA graphs have no timeout: a watcher thread aborts the
communicator as soon as a follower exits, which ends them.
"""

from __future__ import annotations

import fcntl
import json
import os
import select
import subprocess
import sys
import threading
import time
import uuid
import weakref
from collections.abc import Sequence
from datetime import timedelta

import torch
import torch.distributed as dist

from engine.config import EngineConfig
from engine.parallel.block_copy import broadcast_blocks
from engine.parallel.group import TPGroup, host_staged
from engine.parallel.messages import (
    FROM_FOLLOWER,
    Attach,
    Attached,
    AttachFailed,
    FromFollower,
    GraphsReady,
    GraphsStart,
    Hello,
    KvCopy,
    KvReady,
    KvStart,
    SideMessage,
    SideReport,
    Stop,
    ToFollower,
)
from engine.parallel.wire import read_frame, write_frame

WATCH_INTERVAL_S = 0.2  # how soon a dead follower aborts rank 0's captured collectives
_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class TPRankError(RuntimeError):
    """A tensor-parallel rank died or a collective failed: the whole engine is down."""


class TPFollowers:
    def __init__(self, config: EngineConfig, model_path: str, devices: list[str],
                 start_timeout_s: float = 600.0) -> None:
        self.size = len(devices)
        self.timeout_s = config.tp_timeout_s
        self.start_timeout_s = start_timeout_s
        self.failed: TPRankError | None = None
        self._closing = False
        self._watcher: threading.Thread | None = None
        self.store = dist.TCPStore("127.0.0.1", 0, self.size, True, wait_for_workers=False,
                                   timeout=_td(self.timeout_s))
        prefix = f"pdserve-tp-{uuid.uuid4().hex}"
        cfg = {k: v for k, v in config.__dict__.items() if k != "extra"}
        cfg["extra"] = {k: v for k, v in config.extra.items() if _jsonable(v)}
        threads = max(1, torch.get_num_threads() // self.size)
        # rank 0's pool and attention group, for block copies (bind_pool)
        self.kv_cache: torch.Tensor | None = None
        self.attn_group: TPGroup | None = None
        self.procs: list[subprocess.Popen[bytes]] = []
        self.chans: list[int] = []  # read ends: follower -> rank 0
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(
            p for p in (_ROOT, os.environ.get("PYTHONPATH")) if p))
        for rank in range(1, self.size):
            rfd, wfd = os.pipe()
            _widen(rfd)
            args = dict(rank=rank, size=self.size, port=self.store.port, prefix=prefix,
                        device=devices[rank], model_path=model_path, config=cfg,
                        chan_fd=wfd, threads=threads)
            proc = subprocess.Popen(
                [sys.executable, "-m", "engine.parallel.follower", json.dumps(args)],
                stdin=subprocess.PIPE, pass_fds=(wfd,), env=env, cwd=_ROOT)
            os.close(wfd)
            assert proc.stdin is not None
            os.set_blocking(proc.stdin.fileno(), False)  # writes are bounded: write_frame
            self.procs.append(proc)
            self.chans.append(rfd)
        self._finalizer = weakref.finalize(self, _kill_all, list(self.procs), list(self.chans))
        try:
            self._expect(Hello)
            # kept: data-parallel attention builds its groups' communicators on it
            self.group_store = dist.PrefixStore(prefix, self.store)
            self.group = TPGroup(self.group_store, 0, self.size, torch.device(devices[0]),
                                 self.timeout_s, host_staged(config.extra))
        except BaseException:
            self._finalizer()
            raise

    # ---- start-up ------------------------------------------------------------------------

    def start_kv(self, shape: tuple[int, ...], dtype: torch.dtype,
                 kv_scales: tuple[float, ...] = ()) -> None:
        """Each follower allocates its KV cache (rank 0's shape: its own heads), takes rank
        0's float8 scales (engine/kv_scales.py) and reports ready once its weights are
        loaded."""
        self._send_all(KvStart(tuple(shape), str(dtype).removeprefix("torch."),
                               tuple(kv_scales)))
        self._expect(KvReady)

    def bind_pool(self, kv_cache: torch.Tensor, attn_group: TPGroup | None) -> None:
        """Rank 0's KV pool and the attention group it belongs to (its model's group; None:
        a group of one rank), which ``copy_blocks`` reads and broadcasts over."""
        self.kv_cache, self.attn_group = kv_cache, attn_group

    def copy_blocks(self, ranks: Sequence[int], block_ids: Sequence[int]) -> None:
        """Copies blocks from ``ranks[0]``, the first rank of an attention group, to the
        group's other ``ranks`` (engine.parallel.block_copy), behind every plan sent so
        far. A rank that is gone, or a broadcast that fails, fails the engine
        (TPRankError)."""
        self._check_alive()
        msg = KvCopy(tuple(block_ids))
        for r in ranks:
            if r == 0:
                continue
            p = self.procs[r - 1]
            assert p.stdin is not None
            try:
                write_frame(p.stdin.fileno(), msg, self.timeout_s)
            except OSError as e:
                self._check_alive(wait_s=2.0)
                raise self._fail(f"rank {r}: cannot send a block copy ({e})") from e
        if 0 in ranks:
            assert self.kv_cache is not None and self.attn_group is not None, \
                "copy_blocks before bind_pool"
            try:
                broadcast_blocks(self.attn_group, self.kv_cache, block_ids)
            except (RuntimeError, OSError) as e:
                raise self.failure(e) from e

    def start_graphs(self, max_batch: int, max_blocks: int, use_graphs: bool) -> None:
        """Each follower builds its decode buffers and captures the same graphs as rank 0,
        which captures meanwhile (their warm-up runs the collectives for real)."""
        self._send_all(GraphsStart(max_batch, max_blocks, use_graphs))

    def graphs_ready(self, captured: bool) -> None:
        """captured: the graphs hold collectives, which no timeout bounds; a watcher thread
        aborts the communicator when a follower exits, so rank 0 never waits on it forever."""
        self._expect(GraphsReady)
        if captured:
            self.watch()

    def watch(self) -> None:
        """Aborts the communicator as soon as a follower exits (once started), so no
        collective waits the whole timeout for a dead rank."""
        if self._watcher is None:
            self._watcher = threading.Thread(target=self._watch, name="tp-rank-watch",
                                             daemon=True)
            self._watcher.start()

    def _watch(self) -> None:
        while not self._closing:
            if any(p.poll() is not None for p in self.procs):
                if not self._closing:
                    self.group.abort()
                return
            time.sleep(WATCH_INTERVAL_S)

    def attach(self, factory: str, args: bytes, timeout_s: float = 60.0) -> list[bytes]:
        """Starts a rank side (engine.parallel.rank_side) on every follower; returns each
        one's info in rank order (ranks 1..N-1). A follower that cannot start it fails the
        engine, naming the rank and its error."""
        self._send_all(Attach(factory, args))
        got = self._expect(Attached, timeout_s)
        return [g.info for g in got if isinstance(g, Attached)]

    def side(self, rank: int, msg: bytes) -> None:
        """One side message to follower ``rank`` (1..N-1), after the plans sent so far."""
        self._check_alive()
        if self.failed is not None:
            raise self.failed
        p = self.procs[rank - 1]
        assert p.stdin is not None
        try:
            write_frame(p.stdin.fileno(), SideMessage(msg), self.timeout_s)
        except OSError as e:
            self._check_alive(wait_s=2.0)
            raise self._fail(f"rank {rank}: cannot send a side message ({e})") from e

    def reports(self) -> list[tuple[int, bytes]]:
        """(rank, report) the rank sides sent since the last call; never waits. Raises
        TPRankError when a follower is gone or sent something else."""
        self._check_alive()
        out: list[tuple[int, bytes]] = []
        for i, fd in enumerate(self.chans):
            while select.select([fd], [], [], 0)[0]:
                frame = self._read(i, fd)
                if not isinstance(frame, SideReport):
                    raise self._fail(f"rank {i + 1} sent {frame.KIND!r}, expected a report")
                out.append((i + 1, frame.body))
        return out

    def _read(self, i: int, fd: int) -> FromFollower:
        try:
            frame: FromFollower = read_frame(fd, FROM_FOLLOWER)
        except EOFError:
            self._check_alive(wait_s=2.0)
            raise self._fail(f"rank {i + 1} closed its channel") from None
        except ValueError as e:  # MessageError: a follower never sends one; a broken rank
            raise self._fail(f"rank {i + 1}: {e}") from None
        return frame

    def check(self) -> None:
        """TPRankError if a follower exited (cheap: call it every loop turn)."""
        self._check_alive()

    def _expect(self, what: type[FromFollower],
                timeout_s: float | None = None) -> list[FromFollower]:
        """Waits for a ``what`` message from every follower, in rank order; returns them.
        AttachFailed in its place fails the engine with the follower's error."""
        deadline = time.monotonic() + (timeout_s or self.start_timeout_s)
        frames: list[FromFollower] = []
        for i, fd in enumerate(self.chans):
            while True:
                self._check_alive()
                left = deadline - time.monotonic()
                if left <= 0:
                    raise self._fail(f"rank {i + 1} sent no {what.KIND!r} within "
                                     f"{timeout_s or self.start_timeout_s:.0f}s")
                ready, _, _ = select.select([fd], [], [], min(left, 0.2))
                if ready:
                    got = self._read(i, fd)
                    if isinstance(got, SideReport):  # raced ahead of an attach reply
                        continue
                    if isinstance(got, AttachFailed):
                        raise self._fail(f"rank {i + 1} sent {got.KIND!r} ({got.error}), "
                                         f"expected {what.KIND!r}")
                    if not isinstance(got, what):
                        raise self._fail(f"rank {i + 1} sent {got.KIND!r}, expected "
                                         f"{what.KIND!r}")
                    frames.append(got)
                    break
        return frames

    # ---- steps ---------------------------------------------------------------------------

    def send(self, plan: ToFollower) -> None:
        """Hands every follower this step's plan (before rank 0 runs the same forward)."""
        self._check_alive()
        self._send_all(plan)

    def send_each(self, plans: list[ToFollower]) -> None:
        """Hands follower rank r its own plan, plans[r - 1] (data-parallel attention)."""
        self._check_alive()
        self._send_all(None, plans)

    def _send_all(self, obj: ToFollower | None, each: list[ToFollower] | None = None) -> None:
        if self.failed is not None:
            raise self.failed
        for i, p in enumerate(self.procs):
            assert p.stdin is not None
            try:
                write_frame(p.stdin.fileno(), obj if each is None else each[i], self.timeout_s)
            except OSError as e:  # TimeoutError included
                self._check_alive(wait_s=2.0)
                raise self._fail(f"rank {i + 1}: cannot send the step plan ({e})") from e

    # ---- failure -------------------------------------------------------------------------

    def _check_alive(self, wait_s: float = 0.0) -> None:
        if self.failed is not None:
            raise self.failed
        deadline = time.monotonic() + wait_s
        while True:
            for i, p in enumerate(self.procs):
                code = p.poll()
                if code is not None:
                    raise self._fail(f"rank {i + 1} (pid {p.pid}) exited with code {code}")
            if time.monotonic() >= deadline:
                return
            time.sleep(0.05)

    def failure(self, exc: BaseException) -> TPRankError:
        """The error to raise for an exception out of a step: a dead rank if there is one
        (it may take a moment to be reaped after its sockets closed), else the exception."""
        if self.failed is not None:
            return self.failed
        try:
            self._check_alive(wait_s=2.0)
        except TPRankError as e:
            return e
        return self._fail(f"a collective failed ({exc})")

    def _fail(self, why: str) -> TPRankError:
        self.failed = TPRankError(f"tensor parallel engine failed: {why}; the engine is "
                                  "stopped (all ranks)")
        self.close(grace_s=0.0)
        return self.failed

    def close(self, grace_s: float = 2.0) -> None:
        """Stops every follower: a polite Stop, then a kill after grace_s."""
        self._closing = True
        for p in self.procs:
            if p.poll() is None and p.stdin is not None and grace_s > 0:
                try:
                    write_frame(p.stdin.fileno(), Stop(), grace_s)
                except OSError:
                    pass
        deadline = time.monotonic() + grace_s
        for p in self.procs:
            try:
                p.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        self._finalizer()


def _kill_all(procs: list[subprocess.Popen[bytes]], chans: list[int]) -> None:
    for p in procs:
        if p.poll() is None:
            p.kill()
        p.wait()
        if p.stdin is not None:
            p.stdin.close()
    for fd in chans:
        os.close(fd)


def _widen(fd: int) -> None:
    """A follower's reports (transfer outcomes) must never fill the pipe while rank 0 is
    inside a step waiting on that follower's collective: 1 MiB, where Linux allows."""
    try:
        fcntl.fcntl(fd, fcntl.F_SETPIPE_SZ, 1 << 20)
    except (AttributeError, OSError):  # not Linux, or over /proc/sys/fs/pipe-max-size
        pass


def _jsonable(v: object) -> bool:
    try:
        json.dumps(v)
    except TypeError:
        return False
    return True


def _td(seconds: float) -> timedelta:
    return timedelta(seconds=seconds)
