"""KV transfer bandwidth: block-run messages through transfer/ vs the link's raw peak.

    python bench/transfer_bench.py [--backend ucx] [--device cpu|cuda] [--out results.json]

A receiver process and this (sender) process each hold pools. For each message size S the
sender pushes one request made of runs of S bytes (each its own message) and the clock
stops at the consumer's ack, so handshake-free per-request costs (FINISH, ACK) are inside
("transfer": one request's latency). "streamed": ``--stream`` such requests pushed back to
back, clock stopped at the last ack: the pipe's bandwidth, as a producer with several
prefills in flight uses it (what ``ucx_perftest`` measures with its window). Blocks are
min(S, 2 MiB), so a large run is made of Llama-3-8B-sized blocks, as in a real pool.
References measured in the same run: ``ucx_perftest -t tag_bw`` (CPU, if the libucx wheel
ships it; the better of two transport sets, see PERFTEST_TLS), a same-size device copy
(memcpy on CPU; on CUDA, torch's GPU0 -> GPU1 copy).
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

from engine import host_memory  # noqa: E402
from engine.kv_layout import KVLayout  # noqa: E402
from transfer import TransferConfig, TransferNotice, make_receiver, make_sender  # noqa: E402

MIB = 1 << 20
LLAMA = KVLayout("llama-3-8b", "bfloat16", 16, 32, 8, 128, 256)  # 2 MiB blocks
SIZES = [64 << 10 << i for i in range(13)]  # 64 KiB .. 256 MiB


def _sweep_layout(size: int) -> KVLayout:
    """256 MiB pool whose blocks are min(size, 2 MiB): a run of that size is one block up to
    2 MiB (a Llama-3-8B block) and then a run of 2 MiB blocks, as real KV is; the
    transfer's per-block bookkeeping stays at its real share."""
    tokens = 16 * min(size, 2 * MIB) // (64 << 10)  # 4 layers x 4 heads x 64 dim: 4 KiB/token
    return KVLayout(f"sweep-{tokens}", "bfloat16", tokens, 4, 4, 64,
                    (256 * MIB) // (tokens * 4096))


SWEEPS = {s: _sweep_layout(s) for s in SIZES}
LAYOUTS = [*{lay.model: lay for lay in SWEEPS.values()}.values(), LLAMA]


def _pool(lay: KVLayout, device: str) -> torch.Tensor:
    shape = (lay.num_blocks, *lay.block_shape)
    # allocated as the engine allocates its KV cache (huge pages on CPU)
    t = (host_memory.zeros(shape, torch.bfloat16) if device == "cpu"
         else torch.empty(shape, dtype=torch.bfloat16, device=device))
    return t.normal_()  # touched: first-touch page faults stay out of the timing


def _receiver(conn: Any, cfg: TransferConfig, device: str) -> None:
    pools = {lay.model: _pool(lay, device) for lay in LAYOUTS}
    rxs = {lay.model: make_receiver(pools[lay.model], lay, cfg) for lay in LAYOUTS}
    conn.send({k: rx.address for k, rx in rxs.items()})
    while (msg := conn.recv()) is not None:
        model, rids, dst = msg
        for rid in rids:  # streamed requests may share destinations: only bytes are timed
            rxs[model].expect(rid, dst)
        conn.send("ready")
        states = set()
        for rid in rids:
            states.add(rxs[model].wait(rid, 120).status.name)
            rxs[model].release(rid)
        conn.send(",".join(sorted(states)))
    for rx in rxs.values():
        rx.close()


def _one(tx: Any, conn: Any, addr: str, model: str, rid: str,
         chunks: list[tuple[list[int], list[int]]], stream: int = 1) -> float:
    """Seconds for ``stream`` requests of ``chunks`` pushed back to back until all are
    acknowledged (1: one request's latency; more: the pipe's throughput, as a producer
    with several prefills in flight sees it)."""
    rids = [f"{rid}.{i}" for i in range(stream)]
    conn.send((model, rids, [d for _, ds in chunks for d in ds]))
    assert conn.recv() == "ready"
    t0 = time.perf_counter()
    for r in rids:
        for s, d in chunks:
            tx.push(r, addr, s, d)
        tx.finish(r, TransferNotice(r, 1, False, 0))
    us = [tx.wait(r, 120) for r in rids]
    dt = time.perf_counter() - t0
    assert all(u.status.name == "DONE" for u in us) and conn.recv() == "DONE", us
    for r in rids:
        tx.release(r)
    return dt


def _copy_ref(nbytes: int, device: str, reps: int = 5) -> float:
    """Same-size copies: memcpy on CPU, GPU0 -> GPU1 peer copy on CUDA (bytes/s, median).

    Each timing copies >= 64 MiB in S-byte copies, like the transfer it is compared with,
    each from and to its own memory: one buffer copied over and over would time the cache.
    """
    k = max(1, (64 * MIB) // nbytes)
    src = torch.empty(k * nbytes, dtype=torch.uint8, device=device).random_(0, 255)
    dst = torch.zeros(k * nbytes, dtype=torch.uint8,
                      device="cuda:1" if device != "cpu" else "cpu")
    ts = []
    for _ in range(reps + 1):
        if device != "cpu":
            torch.cuda.synchronize(0)
            torch.cuda.synchronize(1)
        t0 = time.perf_counter()
        for i in range(k):
            dst[i * nbytes:(i + 1) * nbytes].copy_(src[i * nbytes:(i + 1) * nbytes])
        if device != "cpu":
            torch.cuda.synchronize(1)
        ts.append(time.perf_counter() - t0)
    return k * nbytes / sorted(ts[1:])[reps // 2]


# UCX's own peak between two local processes, under two transport sets: its default, and
# cross-memory attach alone for the bytes (tcp for rendezvous control). On the 2-core dev
# VM the second is often twice as fast (bench/RESULTS.md, CPU table), though both pick the
# same protocol (rendezvous read over cma): the raw peak is the better of the two.
PERFTEST_TLS = {"default": None, "cma": "cma,tcp"}


def _perftest(nbytes: int, tls: str | None) -> float | None:
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
    env.pop("UCX_TLS", None)
    if tls:
        env["UCX_TLS"] = tls
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
    ap.add_argument("--stream", type=int, default=16,
                    help="requests in flight for the streamed column (0: skip it)")
    ap.add_argument("--out", default="")
    a = ap.parse_args()
    os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")
    tx_dev, rx_dev = ("cpu", "cpu") if a.device == "cpu" else ("cuda:0", "cuda:1")
    cfg = TransferConfig(backend=a.backend, ucx_progress=a.progress)
    # references first, before any pool, peer or mapping exists in these processes: taken
    # after the ipc backend had exported and mapped its pools, torch's peer copies here
    # ran at 1-200 GB/s against 2-371 GB/s in the ucx run of the same invocation (2x H200,
    # cause not found); a slow reference would flatter the ratio. Re-measured at the end.
    copy_refs = {n: _copy_ref(n, tx_dev) for n in [*SIZES, 128 * LLAMA.block_nbytes]}
    ctx = mp.get_context("spawn")
    here, there = ctx.Pipe()
    child = ctx.Process(target=_receiver, args=(there, cfg, rx_dev))
    child.start()
    addrs = here.recv()
    pools = {lay.model: _pool(lay, tx_dev) for lay in LAYOUTS}
    txs = {lay.model: make_sender(pools[lay.model], lay, cfg) for lay in LAYOUTS}
    for k, tx in txs.items():
        tx.connect(addrs[k])
    rows, n = [], 0
    for size in SIZES:
        lay = SWEEPS[size]
        k = size // lay.block_nbytes
        msgs = max(1, min(lay.num_blocks // k, (64 * MIB) // size))  # >= 64 MiB a request
        chunks = [(list(range(i * k, (i + 1) * k)),) * 2 for i in range(msgs)]
        ts = []
        for _ in range(a.reps + 1):
            n += 1
            ts.append(_one(txs[lay.model], here, addrs[lay.model], lay.model, f"s{n}", chunks))
        bw = msgs * size / sorted(ts[1:])[len(ts[1:]) // 2]
        sbw = None
        if a.stream > 1:
            ts = []
            for _ in range(a.reps + 1):
                n += 1
                ts.append(_one(txs[lay.model], here, addrs[lay.model], lay.model, f"m{n}", chunks,
                               a.stream))
            sbw = a.stream * msgs * size / sorted(ts[1:])[len(ts[1:]) // 2]
        peaks = ({k: _perftest(size, tls) for k, tls in PERFTEST_TLS.items()}
                 if a.device == "cpu" else {})
        ref = max((v for v in peaks.values() if v), default=None)
        cp = copy_refs[size]
        rows.append({"msg_bytes": size, "msgs": msgs, "transfer_Bps": bw, "perftest_Bps": ref,
                     **{f"perftest_{k}_Bps": v for k, v in peaks.items()},
                     "copy_Bps": cp, "stream": a.stream, "stream_Bps": sbw})
        pk = f"{ref / 1e9:7.2f}" if ref else "    n/a"
        st = f"{sbw / 1e9:7.2f}" if sbw else "    n/a"
        print(f"{size // 1024:>8} KiB x{msgs:<4} transfer {bw / 1e9:7.2f} GB/s  streamed {st}"
              f"  perftest {pk}"
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
          for i in range(max(a.reps, 5) + 1)]
    t = sorted(ts[1:])[len(ts[1:]) // 2]
    nbytes = 128 * LLAMA.block_nbytes
    ls = max(a.stream, 1)
    ts = [_one(txs["llama-3-8b"], here, addrs["llama-3-8b"], "llama-3-8b", f"L{i}", chunks, ls)
          for i in range(a.reps + 1)]
    st = sorted(ts[1:])[len(ts[1:]) // 2]
    cp = copy_refs[nbytes]
    print(f"llama-3-8b 2k tokens: {nbytes / MIB:.0f} MiB in {t * 1e3:.2f} ms = "
          f"{nbytes / t / 1e9:.2f} GB/s; {ls} in flight: {ls * nbytes / st / 1e9:.2f} GB/s "
          f"(copy of same size {cp / 1e9:.2f} GB/s)", flush=True)
    # the control plane's floor: a one-block request, push to ack
    tiny = [([0], [0])]
    m = SWEEPS[SIZES[0]].model
    ts = [_one(txs[m], here, addrs[m], m, f"t{i}", tiny) for i in range(21)]
    floor = sorted(ts[1:])[10]
    print(f"one-block request ({SWEEPS[SIZES[0]].block_nbytes // 1024} KiB), push to ack: "
          f"{floor * 1e3:.3f} ms (median of 20)", flush=True)
    rows.append({"llama_2k_bytes": nbytes, "seconds": t, "transfer_Bps": nbytes / t,
                 "stream": ls, "stream_Bps": ls * nbytes / st, "copy_Bps": cp,
                 "one_block_seconds": floor})
    for size in (64 * MIB, 256 * MIB):
        after = _copy_ref(size, tx_dev)
        print(f"copy reference {size // MIB} MiB: {copy_refs[size] / 1e9:.1f} GB/s before the "
              f"transfers, {after / 1e9:.1f} GB/s after", flush=True)
        rows.append({"copy_after_bytes": size, "copy_Bps": copy_refs[size],
                     "copy_after_Bps": after})
    here.send(None)
    child.join(60)
    for tx in txs.values():
        tx.close()
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"backend": a.backend, "device": a.device, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
