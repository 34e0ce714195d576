"""Transfer bandwidth between two worker processes, measured with the real backend.

A receiver process holds a pool in the profiled model's KV layout; this process pushes one
request's worth of blocks (a prompt of ``tokens`` tokens, in one chunk, as a producer's
final chunk would be) and stops the clock at the consumer's acknowledgement, so the
per-request costs a producer pays (the finish notice, the ack) are inside.
"""

from __future__ import annotations

import dataclasses
import json
import os
import statistics
import subprocess
import sys
import time

import torch

from engine import host_memory
from engine.kv_layout import KVLayout
from transfer import TransferConfig, TransferNotice, make_receiver, make_sender, plane_probe

TAG = "probe: "


def _pool(layout: KVLayout) -> torch.Tensor:
    dtype = getattr(torch, layout.dtype)
    t = host_memory.zeros((layout.num_blocks, *layout.block_shape), dtype)
    return t.fill_(1)  # touched, so first-touch page faults stay out of the timing


def _receiver_main() -> None:
    """The receiving worker: a line protocol on stdin/stdout (a plain subprocess, so no
    multiprocessing helper process outlives the probe)."""
    layout = KVLayout(*json.loads(sys.stdin.readline()))
    rx = make_receiver(_pool(layout), layout, TransferConfig(backend=sys.argv[1]))
    print(f"{TAG}{rx.address}", flush=True)
    for line in sys.stdin:
        rid = line.strip()
        if not rid:
            break
        rx.expect(rid, list(range(layout.num_blocks)))
        print(f"{TAG}ready", flush=True)
        status = rx.wait(rid, 120).status.name
        rx.release(rid)
        print(f"{TAG}{status}", flush=True)
    rx.close()


def measure_transfer_GBps(layout: KVLayout, tokens: int = 2048, reps: int = 5,
                          backend: str = "ucx") -> float:
    """Median GB/s of pushing ``tokens`` tokens of KV (whole blocks) to another process."""
    blocks = max(1, -(-tokens // layout.block_size))
    lay = dataclasses.replace(layout, num_blocks=blocks)
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    child = subprocess.Popen([sys.executable, "-m", "deploy.plan.transfer_probe", backend],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=root,
                             env={**os.environ, "UCX_WARN_UNUSED_ENV_VARS": "n"})
    assert child.stdin is not None and child.stdout is not None
    tx = None

    def say(line: str) -> None:
        assert child.stdin is not None
        child.stdin.write(line + "\n")
        child.stdin.flush()

    def hear() -> str:
        assert child.stdout is not None
        while line := child.stdout.readline():
            if line.startswith(TAG):  # UCX may print its warnings on stdout too
                return line[len(TAG):].strip()
        raise RuntimeError("transfer probe: the receiver process exited")

    try:
        say(json.dumps(dataclasses.astuple(lay)))
        addr = hear()
        tx = make_sender(_pool(lay), lay, TransferConfig(backend=backend))
        tx.connect(addr)
        ids = list(range(blocks))
        times = []
        for i in range(reps + 1):  # the first push warms the connection up
            rid = f"probe-{i}"
            say(rid)
            if hear() != "ready":
                raise RuntimeError("transfer probe: the receiver did not get ready")
            t0 = time.perf_counter()
            tx.push(rid, addr, ids, ids)
            tx.finish(rid, TransferNotice(rid, 1, False, 0))
            update = tx.wait(rid, 120)
            dt = time.perf_counter() - t0
            if update.status.name != "DONE" or hear() != "DONE":
                raise RuntimeError(f"transfer probe: push {rid} ended {update.status.name}")
            tx.release(rid)
            if i:
                times.append(dt)
        say("")
        return blocks * lay.block_nbytes / statistics.median(times) / 1e9
    finally:
        if tx is not None:
            tx.close()
            # the sender's address-vetting child (transfer/plane_probe.py) would otherwise
            # live until this process exits: in a test run, past the run's end
            plane_probe.close_all()
        try:
            child.wait(10)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()


if __name__ == "__main__":
    _receiver_main()
