"""Small all-reduces on two GPUs: what one TP2 decode step's 65 all-reduces of
[rows, 4096] bf16 cost in one CUDA graph, through NCCL (what engine/parallel/group.py uses)
and through torch's symmetric-memory one-shot all-reduce (NVLink peer loads, no NCCL), to
see whether the latter is worth adopting. One process per GPU.

    python bench/probes/allreduce_probe.py --out OUT.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)
from bench.decode_bench import capture  # noqa: E402

CALLS = 65  # the embedding's all-reduce + 2 per layer of a 32-layer model


def _graph_ms(fn, iters: int = 50) -> float:
    g = capture(fn)
    dist.barrier()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    g.replay()
    a.record()
    for _ in range(iters):
        g.replay()
    b.record()
    b.synchronize()
    return a.elapsed_time(b) / iters


def _rank(r: int, port: int, rows_list: list[int], q: mp.Queue) -> None:
    torch.cuda.set_device(r)
    dev = torch.device("cuda", r)
    store = dist.TCPStore("127.0.0.1", port, 2, r == 0)
    dist.init_process_group("nccl", store=store, rank=r, world_size=2, device_id=dev)
    out: dict = {}
    for rows in rows_list:
        x = torch.randn(rows, 4096, dtype=torch.bfloat16, device=dev)
        out[f"nccl_rows{rows}_ms"] = _graph_ms(lambda x=x: [dist.all_reduce(x)
                                                            for _ in range(CALLS)])
    try:
        import torch.distributed._symmetric_memory as symm

        name = dist.group.WORLD.group_name
        symm.enable_symm_mem_for_group(name)
        for rows in rows_list:
            buf = symm.empty(rows, 4096, dtype=torch.bfloat16, device=dev)
            symm.rendezvous(buf, dist.group.WORLD)
            buf.normal_()
            ref = buf.clone()
            dist.all_reduce(ref)
            got = torch.ops.symm_mem.one_shot_all_reduce(buf, "sum", name)
            torch.cuda.synchronize()
            out[f"symm_rows{rows}_max_err"] = float((got.float() - ref.float()).abs().max())
            out[f"symm_rows{rows}_ms"] = _graph_ms(
                lambda buf=buf: [torch.ops.symm_mem.one_shot_all_reduce(buf, "sum", name)
                                 for _ in range(CALLS)])
    except Exception:  # the result says why
        out["symm_error"] = traceback.format_exc()[-1500:]
    dist.barrier()
    if r == 0:
        q.put(out)
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="1,8,32")
    ap.add_argument("--out", default="allreduce_probe.json")
    args = ap.parse_args()
    rows = [int(v) for v in args.rows.split(",")]
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = 29000 + os.getpid() % 1000
    procs = [ctx.Process(target=_rank, args=(r, port, rows, q)) for r in range(2)]
    for p in procs:
        p.start()
    res = q.get(timeout=240)
    for p in procs:
        p.join(timeout=30)
    res["calls_per_graph"] = CALLS
    print(json.dumps(res, indent=1))
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1)
    sys.exit(0)


if __name__ == "__main__":
    main()
