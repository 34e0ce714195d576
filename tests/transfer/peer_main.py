"""A transfer peer in its own process, for kill / namespace / GPU tests and the benchmark.

    python tests/transfer/peer_main.py recv BACKEND HOST MODE [--device D]
    python tests/transfer/peer_main.py send BACKEND ADDRESS MODE [--device D]

recv prints ``ADDRESS <addr>``; MODE hold: expect and sleep (to be killed); check: expect,
wait for DONE, compare every block with the sender's pattern, print ``OK <n> bytes``.
send MODE hold: push the first chunk, print ``PUSHED``, sleep; all: push every chunk,
finish, wait for the ack, print ``OK``.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

import torch  # noqa: E402

from engine.kv_layout import KVLayout  # noqa: E402
from transfer import TransferConfig, TransferNotice, TransferStatus, make_receiver, make_sender  # noqa: E402  # noqa: E402

RID = "peer-req"
CHUNK = 4  # blocks per push


def layout(big: bool) -> KVLayout:
    if big:  # Llama-3-8B KV: 2 MiB blocks; 2k tokens = 128 blocks
        return KVLayout("llama-3-8b", "bfloat16", 16, 32, 8, 128, 256)
    return KVLayout("tiny", "bfloat16", 16, 4, 2, 64, 64)


def table(lay: KVLayout) -> tuple[list[int], list[int]]:
    """Scattered src and dst block ids, the same in both processes."""
    g = torch.Generator().manual_seed(1234)
    n = lay.num_blocks // 2
    src = torch.randperm(lay.num_blocks, generator=g)[:n].tolist()
    dst = torch.randperm(lay.num_blocks, generator=g)[:n].tolist()
    return src, dst


def pattern(lay: KVLayout, device: str) -> torch.Tensor:
    g = torch.Generator().manual_seed(99)
    t = torch.randn((lay.num_blocks, *lay.block_shape), generator=g, dtype=torch.float32)
    return t.to(torch.bfloat16).to(device)


def config(backend: str, host: str = "127.0.0.1") -> TransferConfig:
    return TransferConfig(backend=backend, host=host, peer_timeout_s=2.0,
                          heartbeat_interval_s=0.25, transfer_timeout_s=60.0)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("role", choices=["recv", "send"])
    ap.add_argument("backend")
    ap.add_argument("where")
    ap.add_argument("mode", choices=["hold", "check", "all"])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--big", action="store_true")
    a = ap.parse_args()
    lay = layout(a.big)
    src, dst = table(lay)
    if a.role == "recv":
        pool = torch.full((lay.num_blocks, *lay.block_shape), -1.0, dtype=torch.bfloat16,
                          device=a.device)
        rx = make_receiver(pool, lay, config(a.backend, a.where))
        rx.expect(RID, dst)
        print("ADDRESS", rx.address, flush=True)
        if a.mode == "hold":
            time.sleep(3600)
        u = rx.wait(RID, 120)
        want = pattern(lay, a.device)
        ok = u.status == TransferStatus.DONE and all(
            torch.equal(pool[d], want[s]) for s, d in zip(src, dst, strict=True))
        untouched = [b for b in range(lay.num_blocks) if b not in set(dst)]
        ok = ok and bool((pool[untouched] == -1).all())
        print("OK" if ok else f"BAD {u}", len(dst) * lay.block_nbytes, "bytes", flush=True)
        rx.release(RID)
        rx.close()
        return
    pool = pattern(lay, a.device)
    tx = make_sender(pool, lay, config(a.backend))
    tx.connect(a.where)
    for i in range(0, len(src), CHUNK):
        tx.push(RID, a.where, src[i:i + CHUNK], dst[i:i + CHUNK])
        if a.mode == "hold":
            while tx.status(RID) == TransferStatus.PENDING:
                time.sleep(0.01)
            print("PUSHED", flush=True)
            time.sleep(3600)
    tx.finish(RID, TransferNotice(RID, 7, False, len(src) * lay.block_size))
    u = tx.wait(RID, 120)
    print("OK" if u.status == TransferStatus.DONE else f"BAD {u}", flush=True)
    tx.release(RID)
    tx.close()


if __name__ == "__main__":
    main()
