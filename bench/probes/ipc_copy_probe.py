"""Why does a copy through a CUDA IPC mapping run below torch's peer copy? (2 GPUs)

    python bench/probes/ipc_copy_probe.py

An owner process allocates a buffer and exports its IPC handle; a copier process on the
other GPU opens it (cuIpcOpenMemHandle, lazy peer access) and times cuMemcpyDtoDAsync
between its own buffer and the mapping with CUDA events, reading (pull) or writing
(push), with or without peer access enabled between the copier's two devices first.
The reference is torch's GPU0 -> GPU1 copy in one process, same sizes, same run.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import sys
from typing import Any

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

MIB = 1 << 20
SIZES = (64 * MIB, 256 * MIB)


def _owner(conn: Any, dev: int, nbytes: int) -> None:
    import torch

    from transfer import cuda_driver

    buf = torch.empty(nbytes, dtype=torch.uint8, device=f"cuda:{dev}").random_(0, 255)
    torch.cuda.synchronize(dev)
    cuda_driver.use_device(dev)
    base, _ = cuda_driver.allocation_of(buf.data_ptr())
    conn.send((cuda_driver.export(base), buf.data_ptr() - base))
    conn.recv()  # the copier is done


def _copier(conn: Any, dev: int, other: int, handle: bytes, offset: int, nbytes: int,
            direction: str, p2p: bool) -> None:
    import torch

    from transfer import cuda_driver

    torch.cuda.set_device(dev)
    cuda_driver.use_device(dev)
    if p2p:  # a tiny cross-device copy makes torch enable peer access both ways
        torch.zeros(1, device=f"cuda:{other}").copy_(torch.ones(1, device=f"cuda:{dev}"))
    local = torch.empty(nbytes, dtype=torch.uint8, device=f"cuda:{dev}").random_(0, 255)
    remote = cuda_driver.open_handle(handle) + offset
    s = torch.cuda.Stream(dev)
    out = {}
    for size in SIZES:
        dst, src = (local.data_ptr(), remote) if direction == "read" else (remote,
                                                                           local.data_ptr())
        ts = []
        for _ in range(11):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record(s)
            cuda_driver.copy_async(dst, src, size, s.cuda_stream)
            b.record(s)
            b.synchronize()
            ts.append(a.elapsed_time(b) / 1e3)
        out[size] = size / sorted(ts[1:])[5]
    conn.send(out)


def _peer_copy() -> dict[int, float]:
    import torch

    out = {}
    for size in SIZES:
        src = torch.empty(size, dtype=torch.uint8, device="cuda:0").random_(0, 255)
        dst = torch.empty(size, dtype=torch.uint8, device="cuda:1")
        dst.copy_(src)
        ts = []
        for _ in range(10):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record(torch.cuda.current_stream(1))
            dst.copy_(src)
            b.record(torch.cuda.current_stream(1))
            b.synchronize()
            ts.append(a.elapsed_time(b) / 1e3)
        out[size] = size / sorted(ts)[5]
    return out


def main() -> None:
    ctx = mp.get_context("spawn")
    n = max(SIZES)
    rows = []
    for direction, owner_dev, copier_dev in (("read", 0, 1), ("write", 1, 0)):
        for p2p in (False, True):
            a, a2 = ctx.Pipe()
            owner = ctx.Process(target=_owner, args=(a2, owner_dev, n))
            owner.start()
            handle, off = a.recv()
            b, b2 = ctx.Pipe()
            cp = ctx.Process(target=_copier, args=(b2, copier_dev, owner_dev, handle, off, n,
                                                   direction, p2p))
            cp.start()
            res = b.recv()
            cp.join(60)
            a.send("done")
            owner.join(60)
            rows.append((f"{direction} GPU{copier_dev}<-map of GPU{owner_dev}"
                         f"{' +peer access' if p2p else ''}", res))
    rows.append(("torch peer copy GPU0->GPU1, one process", _peer_copy()))
    print(f"{'case':<48}" + "".join(f"{s // MIB:>8} MiB" for s in SIZES))
    for name, res in rows:
        print(f"{name:<48}" + "".join(f"{res[s] / 1e9:>8.1f} GB/s"[:12].rjust(12)
                                      for s in SIZES))


if __name__ == "__main__":
    main()
