"""The transfer control plane's own cost, with almost no bytes to move (this machine).

    python bench/transfer_control_bench.py [--backend ipc] [--requests 16] [--pushes 8]

A sender and a receiver in this process (one GIL, as in the contract tests), one-block
pushes of a tiny layout: ``--requests`` requests of ``--pushes`` pushes each, all pushed
back to back, clock stopped at the last ack; reports microseconds per push (best of 5).
Also times ``block_runs`` on 4096 blocks, contiguous and fully scattered: the per-block
work a push does on the engine's thread.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import torch  # noqa: E402

from engine.kv_layout import KVLayout  # noqa: E402
from transfer import TransferConfig, TransferNotice, make_receiver, make_sender  # noqa: E402
from transfer.pool import block_runs  # noqa: E402

LAYOUT = KVLayout("tiny", "bfloat16", 16, 4, 2, 64, 64)  # 32 KiB blocks


def per_push_us(backend: str, requests: int, pushes: int) -> float:
    shape = (LAYOUT.num_blocks, *LAYOUT.block_shape)
    cfg = TransferConfig(backend=backend)
    rx = make_receiver(torch.zeros(shape, dtype=torch.bfloat16), LAYOUT, cfg)
    tx = make_sender(torch.ones(shape, dtype=torch.bfloat16), LAYOUT, cfg)
    try:
        tx.connect(rx.address, timeout=10)
        best = float("inf")
        for rep in range(6):  # the first warms up
            rids = [f"r{rep}.{i}" for i in range(requests)]
            for r in rids:
                rx.expect(r, list(range(20, 20 + pushes)))
            t0 = time.perf_counter()
            for r in rids:
                for k in range(pushes):
                    tx.push(r, rx.address, [k], [20 + k])
                tx.finish(r, TransferNotice(r, 1, False, 0))
            for r in rids:
                assert tx.wait(r, 30).status.name == "DONE"
            dt = time.perf_counter() - t0
            for r in rids:
                rx.wait(r, 30)
                rx.release(r)
                tx.release(r)
            if rep:
                best = min(best, dt)
        return best / (requests * pushes) * 1e6
    finally:
        tx.close()
        rx.close()


def block_runs_ms(scattered: bool) -> float:
    ids = random.Random(0).sample(range(5000), 4096) if scattered else list(range(4096))
    ts = []
    for _ in range(5):
        t0 = time.perf_counter()
        block_runs(ids, ids)
        ts.append(time.perf_counter() - t0)
    return min(ts) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--backend", default="ipc")
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--pushes", type=int, default=8)
    a = ap.parse_args()
    os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")
    print(f"{a.backend}: {per_push_us(a.backend, a.requests, a.pushes):.1f} us per push "
          f"({a.requests} requests x {a.pushes} pushes in flight)")
    print(f"block_runs, 4096 blocks: contiguous {block_runs_ms(False):.2f} ms, "
          f"scattered {block_runs_ms(True):.2f} ms")


if __name__ == "__main__":
    main()
