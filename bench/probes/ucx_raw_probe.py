"""What bare ucxx reaches between two local processes, with pdserve's UCX settings
(progress thread in epoll mode, delayed submission, error handling off) and none of
pdserve's control plane: the ceiling for the ucx backend on this host.

    python bench/probes/ucx_raw_probe.py [--mib 64] [--msgs 8] [--late] [--poll]
                                  [--alloc numpy|torch|pdserve]

``--late``: the receiver posts each receive only after the sender announced that message
over a pipe, as the ucx backend does (it posts on the PUSH announce); without it every
receive is posted before the first send. ``--poll``: no progress thread; each process's
main thread calls ``worker.progress()`` in a loop while it waits, as ``ucx_perftest`` does.
``--alloc``: who allocates both buffers: numpy (asks for transparent huge pages itself),
torch's CPU allocator (4 KiB pages where THP is in madvise mode), or pdserve's KV-pool
allocator (``engine.host_memory``, huge pages).
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import sys
import time
from typing import Any

import numpy as np

REPS = 4  # the first is warm-up (page faults, registration)


def _alloc(kind: str, n: int) -> Any:
    if kind == "numpy":
        return np.ones(n, dtype=np.uint8)
    import torch

    if kind == "torch":
        return torch.ones(n, dtype=torch.uint8).numpy()
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
    from engine.host_memory import zeros

    return zeros((n,), torch.uint8).fill_(1).numpy()


def _worker(poll: bool) -> tuple[Any, Any, Any]:
    import ucxx._lib.libucxx as ucx

    ctx = ucx.UCXContext(feature_flags=(ucx.Feature.TAG, ucx.Feature.WAKEUP))
    w = ucx.UCXWorker(ctx, enable_delayed_submission=not poll)
    if not poll:
        w.start_progress_thread(polling_mode=False, epoll_timeout=1)
    return ucx, ctx, w


def _wait(conn: Any, w: Any, poll: bool) -> Any:
    """conn.recv(), progressing the worker meanwhile in --poll mode."""
    while poll and not conn.poll():
        w.progress()
    return conn.recv()


def _endpoint(ucx: Any, w: Any, info: bytes) -> Any:
    addr = ucx.UCXAddress.create_from_buffer(info)
    return ucx.UCXEndpoint.create_from_worker_address(w, addr, False)


def _receiver(conn: Any, size: int, n: int, late: bool, poll: bool, alloc: str) -> None:
    from ucxx._lib.arr import Array

    ucx, ctx, w = _worker(poll)
    conn.send(bytes(w.address.tobytes()))
    ep = _endpoint(ucx, w, conn.recv())
    buf = _alloc(alloc, size * n)
    conn.send("ready")
    for rep in range(REPS):
        conn.recv()
        reqs = []
        for i in range(n):
            if late:
                _wait(conn, w, poll)  # the announce
            reqs.append(ep.tag_recv(Array(buf[i * size:(i + 1) * size]),
                                    ucx.UCXXTag(rep * 1000 + i), ucx.UCXXTagMaskFull))
        while not all(r.completed for r in reqs):
            if poll:
                w.progress()
            else:
                time.sleep(0.0001)
        conn.send("done")
    conn.recv()  # stays up until the sender has its numbers
    if not poll:
        w.stop_progress_thread()
    os._exit(0)  # see main()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mib", type=int, default=64)
    ap.add_argument("--msgs", type=int, default=8)
    ap.add_argument("--late", action="store_true")
    ap.add_argument("--poll", action="store_true")
    ap.add_argument("--alloc", choices=["numpy", "torch", "pdserve"], default="numpy")
    a = ap.parse_args()
    os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")
    size = a.mib << 20
    from ucxx._lib.arr import Array

    ucx, ctx, w = _worker(a.poll)
    here, there = mp.get_context("spawn").Pipe()
    child = mp.get_context("spawn").Process(
        target=_receiver, args=(there, size, a.msgs, a.late, a.poll, a.alloc), daemon=True)
    child.start()
    ep = _endpoint(ucx, w, here.recv())
    here.send(bytes(w.address.tobytes()))
    src = _alloc(a.alloc, size * a.msgs)
    assert here.recv() == "ready"
    rates = []
    for rep in range(REPS):
        here.send("go")
        t0 = time.perf_counter()
        reqs = []
        for i in range(a.msgs):
            reqs.append(ep.tag_send(Array(src[i * size:(i + 1) * size]),
                                    ucx.UCXXTag(rep * 1000 + i)))
            if a.late:
                here.send("announce")
        assert _wait(here, w, a.poll) == "done"
        rates.append(size * a.msgs / (time.perf_counter() - t0))
    here.send("bye")
    child.join(10)
    best = sorted(rates[1:])[len(rates[1:]) // 2]
    mode = ((" (late receives)" if a.late else "") + (" (main-thread polling)" if a.poll else "")
            + f" ({a.alloc} memory)")
    print(f"ucxx tag {a.mib} MiB x{a.msgs}{mode}: "
          f"{best / 1e9:.2f} GB/s (median of {REPS - 1}; "
          f"{', '.join(f'{r / 1e9:.2f}' for r in rates[1:])})", flush=True)
    if not a.poll:
        w.stop_progress_thread()
    # ucxx's endpoint and worker destructors can block at interpreter exit once the peer
    # is gone; nothing is left to release
    os._exit(0)


if __name__ == "__main__":
    main()
