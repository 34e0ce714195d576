"""The board a worker's gRPC process writes and its heartbeat process reads: shared memory.

What the heartbeat says (worker/heartbeat_process.py) is the engine's latest load report
and how far behind the gRPC process's event loop runs. Both are known on that loop; the
heartbeat leaves from another process so that nothing in the gRPC process (its GIL, its CPU
share) can delay it. The loop writes here at each of its ticks (worker/loop_watch.py):
stores into shared memory, no system call, no message. The heartbeat process reads when it
beats.

Layout (native byte order; both sides are the same machine and interpreter build):

    0   seq        u64  seqlock: odd while the loop writes
    8   tick_s     f64  the loop's tick period
    16  ticked     f64  time.monotonic() of the loop's last tick (system-wide clock)
    24  peak       f64  the worst tick lateness since the reader's last read
    32  engine_age f64  age of the engine's last report, in loop time, at the last tick
    40  read_gen   u64  bumped by the reader after each read: the writer then restarts peak
    48  load_len   u32  length of the serialized ``WorkerLoad`` that follows
    56  load       bytes

Each field has one writer (``read_gen``: the reader; the rest: the loop). A read that races
a write retries (the seqlock); the peak's restart may lose one tick's lateness to a race
between the read and the bump, so one heartbeat can under-report a stall that already
ended, never one in progress (that shows from ``ticked``).
"""

from __future__ import annotations

import ctypes
import struct
import time
from collections.abc import Callable
from typing import Any

_HEAD = struct.Struct("=QddddQI")  # the whole header, as the reader takes it
_TICK = struct.Struct("=dddd")  # tick_s, ticked, peak, engine_age: the loop's, after seq
_U64, _U32 = struct.Struct("=Q"), struct.Struct("=I")
_TICK_AT, _GEN_AT, _LEN_AT, _LOAD_AT = 8, 40, 48, 56
# A WorkerLoad is a few dozen bytes plus ~15 a data-parallel rank: far under this.
SIZE = 64 * 1024
LOAD_MAX = SIZE - _LOAD_AT


def new_raw(ctx: Any) -> Any:
    """The shared block, from a multiprocessing context: it pickles into a spawned child."""
    return ctx.RawArray(ctypes.c_char, SIZE)


class LoadBoard:
    """One side's view of the block (``raw``: ``new_raw``'s array, here or in the child)."""

    def __init__(self, raw: Any, clock: Callable[[], float] = time.monotonic) -> None:
        self.raw = raw
        self._mem = memoryview(raw).cast("B")
        self._clock = clock
        self._gen_seen = 0  # the writer's: the reader generation its peak started at
        self._peak = 0.0

    # -- the loop's side ------------------------------------------------------------------

    def tick(self, tick_s: float, ticked: float, late: float, engine_age: float,
             load: bytes | None = None) -> None:
        """One tick's news; ``load``: a new serialized report (None: keep the last)."""
        mem = self._mem
        seq = _U64.unpack_from(mem)[0]
        gen = _U64.unpack_from(mem, _GEN_AT)[0]
        if gen != self._gen_seen:  # the reader took the peak: start a new one
            self._gen_seen, self._peak = gen, 0.0
        self._peak = max(self._peak, late)
        if load is not None and len(load) > LOAD_MAX:
            raise ValueError(f"load report of {len(load)} bytes; the board holds {LOAD_MAX}")
        _U64.pack_into(mem, 0, seq + 1)
        _TICK.pack_into(mem, _TICK_AT, tick_s, ticked, self._peak, engine_age)
        if load is not None:
            _U32.pack_into(mem, _LEN_AT, len(load))
            mem[_LOAD_AT:_LOAD_AT + len(load)] = load
        _U64.pack_into(mem, 0, seq + 2)

    # -- the heartbeat's side -------------------------------------------------------------

    def read(self) -> tuple[float, float, bytes]:
        """(loop lag, engine report age, serialized load) for one heartbeat; the lag is the
        loop's present lateness or the worst one since the last read, whichever is more."""
        mem = self._mem
        while True:
            seq, tick_s, ticked, peak, age, gen, n = _HEAD.unpack_from(mem)
            load = bytes(mem[_LOAD_AT:_LOAD_AT + n])
            if seq % 2 == 0 and _U64.unpack_from(mem)[0] == seq:
                break
            time.sleep(0)  # the loop is mid-write: a few stores, then it is done
        _U64.pack_into(mem, _GEN_AT, gen + 1)
        lag = max(0.0, self._clock() - ticked - tick_s, peak)
        return lag, age, load
