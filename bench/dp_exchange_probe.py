"""The MoE token exchange of data-parallel attention, alone: all-gather + reduce-scatter (what
engine/parallel/dp_exchange.py does) against all-to-all dispatch + combine, at decode batch
sizes, on T ranks (one process each).

    python bench/dp_exchange_probe.py --out $OUT/dp_exchange.json            (2 GPUs, NCCL)
    python bench/dp_exchange_probe.py --device cpu --out /tmp/dp_exchange.json  (gloo)

Per point: m tokens per rank of hidden size H, each routed to k of E experts (uniformly at
random: the rows a rank sends a peer are those with at least one expert there). AG+RS:
all-gather [m, H] from every rank, reduce-scatter [T m, H] back. All-to-all: the per-peer
row counts first (routing-dependent sizes), the rows to each peer, and the same rows back
(each peer's partial sum), then a local index-add. Neither runs the experts: this is the
communication only. Median of ``--reps`` timed passes after warm-up, the slowest rank's.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def _time(fn: Any, dev: torch.device, reps: int) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(reps):
        _sync(dev)
        t0 = time.perf_counter()
        fn()
        _sync(dev)
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def _point(m: int, rank: int, size: int, dev: torch.device, dtype: torch.dtype,
           gen: torch.Generator, args: argparse.Namespace) -> dict[str, Any]:
    h, e, k = args.hidden, args.experts, args.top_k
    per = e // size
    x = torch.randn(m, h, dtype=dtype, device=dev)
    ids = torch.stack([torch.randperm(e, generator=gen)[:k] for _ in range(m)])  # [m, k]
    owner = ids // per  # [m, k]: the rank holding each pick
    # rows to each peer: tokens with at least one pick there, in peer order
    to = [torch.nonzero((owner == r).any(dim=1)).flatten() for r in range(size)]
    send_counts = torch.tensor([len(t) for t in to], dtype=torch.int64)
    order = torch.cat(to).to(dev)

    def ag_rs() -> None:
        full = torch.empty(size * m, h, dtype=dtype, device=dev)
        dist.all_gather_into_tensor(full, x)
        back = torch.empty(m, h, dtype=dtype, device=dev)
        dist.reduce_scatter_tensor(back, full)

    def a2a() -> None:
        counts = send_counts.to(dev)
        recv_counts = torch.empty_like(counts)
        dist.all_to_all_single(recv_counts, counts)
        rc = recv_counts.cpu().tolist()  # the host needs the sizes: a sync
        sc = send_counts.tolist()
        rows = x.index_select(0, order)
        got = torch.empty(sum(rc), h, dtype=dtype, device=dev)
        dist.all_to_all_single(got, rows, rc, sc)
        ret = torch.empty(len(order), h, dtype=dtype, device=dev)
        dist.all_to_all_single(ret, got, sc, rc)
        y = torch.zeros(m, h, dtype=dtype, device=dev)
        y.index_add_(0, order, ret)

    worst = torch.tensor([_time(ag_rs, dev, args.reps), _time(a2a, dev, args.reps)],
                         dtype=torch.float64, device=dev)
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)  # the slowest rank's
    t_ag, t_a2a = worst.cpu().tolist()
    return {"tokens_per_rank": m, "ag_rs_ms": t_ag, "all_to_all_ms": t_a2a,
            "rows_sent_per_rank_a2a": int(send_counts.sum() - send_counts[rank])}


def _worker(rank: int, size: int, port: int, args: argparse.Namespace, q: Any) -> None:
    cuda = args.device.startswith("cuda")
    dev = torch.device(f"cuda:{rank}" if cuda else "cpu")
    if cuda:
        torch.cuda.set_device(dev)
    store = dist.TCPStore("127.0.0.1", port, size, rank == 0, timeout=timedelta(seconds=120))
    dist.init_process_group("nccl" if cuda else "gloo", store=store, rank=rank,
                            world_size=size, timeout=timedelta(seconds=120))
    dtype = torch.bfloat16 if cuda else torch.float32
    gen = torch.Generator().manual_seed(rank)
    out = [_point(m, rank, size, dev, dtype, gen, args) for m in args.tokens]
    if rank == 0:
        q.put(out)
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--tokens", default="64,128,256", help="tokens per rank")
    ap.add_argument("--hidden", type=int, default=2048)  # DeepSeek-V2-Lite
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--top-k", type=int, default=6)
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args()
    args.tokens = [int(t) for t in args.tokens.split(",")]
    if args.device.startswith("cuda") and torch.cuda.device_count() < args.ranks:
        ap.error(f"{args.ranks} ranks need {args.ranks} CUDA devices (or --device cpu)")
    if args.experts % args.ranks:
        ap.error("--experts: must be a multiple of --ranks")
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = 29500 + os.getpid() % 1000
    procs = [ctx.Process(target=_worker, args=(r, args.ranks, port, args, q))
             for r in range(args.ranks)]
    for p in procs:
        p.start()
    points = q.get(timeout=600)
    for p in procs:
        p.join(timeout=60)
    res = {"command": "python " + " ".join(sys.argv), "device": args.device,
           "ranks": args.ranks, "hidden": args.hidden, "experts": args.experts,
           "top_k": args.top_k, "points": points}
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1)
    print(json.dumps(points))


if __name__ == "__main__":
    main()
