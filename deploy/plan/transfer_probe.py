"""Transfer bandwidth between two worker processes, measured with the real backend.

A receiver process holds a pool in the profiled model's KV layout; this process pushes one
request's worth of blocks (a prompt of ``tokens`` tokens, in one chunk, as a producer's
final chunk would be) and stops the clock at the consumer's acknowledgement, so the
per-request costs a producer pays (the finish notice, the ack) are inside.
"""

from __future__ import annotations

import dataclasses
import multiprocessing as mp
import statistics
import time
from typing import Any

import torch

from engine import host_memory
from engine.kv_layout import KVLayout
from transfer import TransferConfig, TransferNotice, make_receiver, make_sender


def _pool(layout: KVLayout) -> torch.Tensor:
    dtype = getattr(torch, layout.dtype)
    t = host_memory.zeros((layout.num_blocks, *layout.block_shape), dtype)
    return t.fill_(1)  # touched, so first-touch page faults stay out of the timing


def _receiver(conn: Any, layout: KVLayout, cfg: TransferConfig) -> None:
    rx = make_receiver(_pool(layout), layout, cfg)
    conn.send(rx.address)
    while (rid := conn.recv()) is not None:
        rx.expect(rid, list(range(layout.num_blocks)))
        conn.send("ready")
        status = rx.wait(rid, 120).status.name
        rx.release(rid)
        conn.send(status)
    rx.close()


def measure_transfer_GBps(layout: KVLayout, tokens: int = 2048, reps: int = 5,
                          backend: str = "ucx") -> float:
    """Median GB/s of pushing ``tokens`` tokens of KV (whole blocks) to another process."""
    blocks = max(1, -(-tokens // layout.block_size))
    lay = dataclasses.replace(layout, num_blocks=blocks)
    cfg = TransferConfig(backend=backend)
    ctx = mp.get_context("spawn")
    here, there = ctx.Pipe()
    child = ctx.Process(target=_receiver, args=(there, lay, cfg), daemon=True)
    child.start()
    tx = None
    try:
        addr = here.recv()
        tx = make_sender(_pool(lay), lay, cfg)
        tx.connect(addr)
        ids = list(range(blocks))
        times = []
        for i in range(reps + 1):  # the first push warms the connection up
            rid = f"probe-{i}"
            here.send(rid)
            if here.recv() != "ready":
                raise RuntimeError("transfer probe: the receiver did not get ready")
            t0 = time.perf_counter()
            tx.push(rid, addr, ids, ids)
            tx.finish(rid, TransferNotice(rid, 1, False, 0))
            update = tx.wait(rid, 120)
            dt = time.perf_counter() - t0
            if update.status.name != "DONE" or here.recv() != "DONE":
                raise RuntimeError(f"transfer probe: push {rid} ended {update.status.name}")
            tx.release(rid)
            if i:
                times.append(dt)
        here.send(None)
        return blocks * lay.block_nbytes / statistics.median(times) / 1e9
    finally:
        if tx is not None:
            tx.close()
        child.join(10)
        if child.is_alive():
            child.kill()
            child.join()
