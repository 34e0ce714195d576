"""KV transfer bandwidth: block-run messages through transfer/ vs the link's raw peak.

    python bench/transfer_bench.py [--backend ucx] [--device cpu|cuda] [--out results.json]

A receiver process and this (sender) process each hold a pool. For each message size S the
sender pushes one request made of runs of S bytes (each its own message) and the clock
stops at the consumer's ack, so handshake-free per-request costs (FINISH, ACK) are inside.
References measured in the same run: ``ucx_perftest -t tag_bw`` (CPU, if the libucx wheel
ships it), a same-size device copy (memcpy on CPU; on CUDA, torch's GPU0 -> GPU1 copy).
The realistic request is Llama-3-8B KV (32 layers, 8 KV heads, dim 128, bf16), 2k tokens
in block-size-16 blocks: 128 blocks of 2 MiB pushed in 8 chunks, scattered destinations.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import re
import subprocess
import sys
import time
from typing import Any

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import torch  # noqa: E402

from engine.kv_layout import KVLayout  # noqa: E402
from transfer import TransferConfig, TransferNotice, make_receiver, make_sender  # noqa: E402

MIB = 1 << 20
SWEEP = KVLayout("bench", "bfloat16", 16, 4, 4, 64, 4096)  # 64 KiB blocks, 256 MiB pool
LLAMA = KVLayout("llama-3-8b", "bfloat16", 16, 32, 8, 128, 256)  # 2 MiB blocks


def _pool(lay: KVLayout, device: str) -> torch.Tensor:
    t = torch.empty((lay.num_blocks, *lay.block_shape), dtype=torch.bfloat16, device=device)
    return t.normal_()  # touched: first-touch page faults stay out of the timing


def _receiver(conn: Any, cfg: TransferConfig, device: str) -> None:
    pools = {lay.model: _pool(lay, device) for lay in (SWEEP, LLAMA)}
    rxs = {k: make_receiver(p, lay, cfg)
           for (k, p), lay in zip(pools.items(), (SWEEP, LLAMA), strict=True)}
    conn.send({k: rx.address for k, rx in rxs.items()})
    while (msg := conn.recv()) is not None:
        model, rid, dst = msg
        rxs[model].expect(rid, dst)
        conn.send("ready")
        u = rxs[model].wait(rid, 120)
        rxs[model].release(rid)
        conn.send(u.status.name)
    for rx in rxs.values():
        rx.close()


def _one(tx: Any, conn: Any, addr: str, model: str, rid: str,
         chunks: list[tuple[list[int], list[int]]]) -> float:
    conn.send((model, rid, [d for _, ds in chunks for d in ds]))
    assert conn.recv() == "ready"
    t0 = time.perf_counter()
    for s, d in chunks:
        tx.push(rid, addr, s, d)
    tx.finish(rid, TransferNotice(rid, 1, False, 0))
    u = tx.wait(rid, 120)
    dt = time.perf_counter() - t0
    assert u.status.name == "DONE" and conn.recv() == "DONE", u
    tx.release(rid)
    return dt


def _copy_ref(nbytes: int, device: str, reps: int = 5) -> float:
    """Same-size copies: memcpy on CPU, GPU0 -> GPU1 peer copy on CUDA (bytes/s, median).

    Each timing copies >= 64 MiB in S-byte copies, like the transfer it is compared with."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device).random_(0, 255)
    dst = torch.zeros(nbytes, dtype=torch.uint8, device="cuda:1" if device != "cpu" else "cpu")
    k = max(1, (64 * MIB) // nbytes)
    ts = []
    for _ in range(reps + 1):
        if device != "cpu":
            torch.cuda.synchronize(0)
            torch.cuda.synchronize(1)
        t0 = time.perf_counter()
        for _ in range(k):
            dst.copy_(src)
        if device != "cpu":
            torch.cuda.synchronize(1)
        ts.append(time.perf_counter() - t0)
    return k * nbytes / sorted(ts[1:])[reps // 2]


def _perftest(nbytes: int) -> float | None:
    """``ucx_perftest -t tag_bw`` between two local processes, bytes/s; None if absent."""
    try:
        import libucx  # type: ignore[import-not-found]
    except ImportError:
        return None
    root = os.path.dirname(libucx.__file__)
    exe = os.path.join(root, "bin", "ucx_perftest")
    if not os.path.exists(exe):
        return None
    env = {**os.environ, "LD_LIBRARY_PATH": os.path.join(root, "lib"),
           "UCX_WARN_UNUSED_ENV_VARS": "n"}
    port = str(20000 + os.getpid() % 20000)
    iters = str(max(20, min(1000, (2 << 30) // nbytes)))
    srv = subprocess.Popen([exe, "-p", port], env=env, stdout=subprocess.DEVNULL,
                           stderr=subprocess.DEVNULL)
    try:
        time.sleep(0.5)
        out = subprocess.run([exe, "127.0.0.1", "-p", port, "-t", "tag_bw", "-s", str(nbytes),
                              "-n", iters, "-w", "5"], env=env, capture_output=True, text=True,
                             timeout=120).stdout
    finally:
        srv.kill()
        srv.wait()
    m = re.search(r"Final:\s+\d+\s+\S+\s+\S+\s+\S+\s+(\S+)", out)
    return float(m.group(1)) * MIB if m else None  # perftest's MB/s are MiB/s


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--backend", default="ucx")
    ap.add_argument("--device", default="cpu", help="cpu, or cuda (sender GPU0, receiver GPU1)")
    ap.add_argument("--progress", default="thread", help="ucx_progress: thread | thread-polling")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--out", default="")
    a = ap.parse_args()
    os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")
    tx_dev, rx_dev = ("cpu", "cpu") if a.device == "cpu" else ("cuda:0", "cuda:1")
    cfg = TransferConfig(backend=a.backend, ucx_progress=a.progress)
    ctx = mp.get_context("spawn")
    here, there = ctx.Pipe()
    child = ctx.Process(target=_receiver, args=(there, cfg, rx_dev))
    child.start()
    addrs = here.recv()
    pools = {lay.model: _pool(lay, tx_dev) for lay in (SWEEP, LLAMA)}
    txs = {lay.model: make_sender(pools[lay.model], lay, cfg)
           for lay in (SWEEP, LLAMA)}
    for k, tx in txs.items():
        tx.connect(addrs[k])
    rows, n = [], 0
    for size in [64 << 10 << i for i in range(13)]:  # 64 KiB .. 256 MiB
        k = size // SWEEP.block_nbytes
        msgs = max(1, min(SWEEP.num_blocks // k, (64 * MIB) // size))  # >= 64 MiB a request
        chunks = [(list(range(i * k, (i + 1) * k)),) * 2 for i in range(msgs)]
        ts = []
        for _ in range(a.reps + 1):
            n += 1
            ts.append(_one(txs["bench"], here, addrs["bench"], "bench", f"s{n}", chunks))
        bw = msgs * size / sorted(ts[1:])[len(ts[1:]) // 2]
        ref = _perftest(size) if a.device == "cpu" else None
        cp = _copy_ref(size, tx_dev)
        rows.append({"msg_bytes": size, "msgs": msgs, "transfer_Bps": bw, "perftest_Bps": ref,
                     "copy_Bps": cp})
        pk = f"{ref / 1e9:7.2f}" if ref else "    n/a"
        print(f"{size // 1024:>8} KiB x{msgs:<4} transfer {bw / 1e9:7.2f} GB/s  perftest {pk}"
              f"  copy {cp / 1e9:7.2f}  ratio(vs perftest) "
              f"{(bw / ref) if ref else float('nan'):.2f}  ratio(vs copy) {bw / cp:.2f}",
              flush=True)
    g = torch.Generator().manual_seed(0)
    src = torch.randperm(LLAMA.num_blocks, generator=g)[:128].tolist()  # 2k tokens
    dst = torch.randperm(LLAMA.num_blocks, generator=g)[:128].tolist()
    src.sort()
    dst.sort()  # a fresh pool's allocator hands out mostly-adjacent blocks: a few runs each
    chunks = [(src[i:i + 16], dst[i:i + 16]) for i in range(0, 128, 16)]  # 8 prefill chunks
    ts = [_one(txs["llama-3-8b"], here, addrs["llama-3-8b"], "llama-3-8b", f"l{i}", chunks)
          for i in range(a.reps + 1)]
    t = sorted(ts[1:])[len(ts[1:]) // 2]
    nbytes = 128 * LLAMA.block_nbytes
    cp = _copy_ref(nbytes, tx_dev)
    print(f"llama-3-8b 2k tokens: {nbytes / MIB:.0f} MiB in {t * 1e3:.1f} ms = "
          f"{nbytes / t / 1e9:.2f} GB/s (copy of same size {cp / 1e9:.2f} GB/s)", flush=True)
    rows.append({"llama_2k_bytes": nbytes, "seconds": t, "transfer_Bps": nbytes / t,
                 "copy_Bps": cp})
    here.send(None)
    child.join(60)
    for tx in txs.values():
        tx.close()
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"backend": a.backend, "device": a.device, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
