"""The collectives of one tensor-parallel step, timed alone (bench/tp_bench.py's all-reduce
share).

``step_collectives`` lists what one forward of engine/models/llama.py issues under TP N, in
order: the vocabulary-parallel embedding's all-reduce and two per decoder layer (attention
output, MLP output), each [T, hidden] in the model's dtype; then, when rows are sampled,
the LM head's all-gather of [S, vocab/N] logits (model dtype) and rank 0's broadcast of the S
sampled ids (int64) that the runner adds after the forward, except in a decode step whose
rows all sample in the decode graphs' head (engine/parallel/graph_step.py).
tests/bench/test_tp_collectives.py checks this list against what a real TP2 engine calls.

``time_collectives`` starts one process per rank (rank r on cuda:r, or all on the CPU with
gloo), joins them through the engine's own ``TPGroup`` (the same NCCL/gloo calls the model
makes) and, for each named plan, runs the plan's collectives back to back: captured in one
CUDA graph per rank where capture works on every rank (else eagerly), and reports the
mean ms of one pass over ``iters`` passes (the slower rank's). Nothing else runs between
them, so this is the collectives' own cost, without the waits for a slower rank that a
real step's collectives also absorb.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

KINDS = ("all_reduce", "all_gather", "broadcast")


@dataclass(frozen=True)
class Collective:
    kind: str  # one of KINDS (TPGroup's all_reduce, all_gather_cat, broadcast)
    shape: tuple[int, ...]  # of each rank's input
    dtype: str  # torch dtype name, e.g. "bfloat16"

    @property
    def nbytes(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n * {"bfloat16": 2, "float16": 2, "float32": 4, "int64": 8}[self.dtype]


def step_collectives(model_cfg: dict[str, Any], tp: int, tokens: int, sampled: int,
                     dtype: str, broadcast: bool = True) -> list[Collective]:
    """One step of ``tokens`` input tokens of which ``sampled`` rows are sampled.
    broadcast=False: a pure-decode step whose rows all sample in the decode graphs' head,
    where every rank draws the same ids and rank 0 broadcasts nothing."""
    hidden, layers = model_cfg["hidden_size"], model_cfg["num_hidden_layers"]
    vocab_shard = -(-model_cfg["vocab_size"] // tp)  # shards.py: ceil(vocab / tp), padded
    ops = [Collective("all_reduce", (tokens, hidden), dtype)] * (1 + 2 * layers)
    if sampled:
        ops.append(Collective("all_gather", (sampled, vocab_shard), dtype))
        if broadcast:
            ops.append(Collective("broadcast", (sampled,), "int64"))
    return ops


def time_collectives(plans: dict[str, list[Collective]], tp: int, device: str,
                     iters: int = 20, timeout_s: float = 180.0) -> dict[str, dict[str, Any]]:
    """name -> {"ms", "graph", "ops", "mib"}: one pass over each plan on ``tp`` ranks
    (device "cuda": rank r on cuda:r; "cpu": gloo). Raises RuntimeError when a rank fails."""
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, tp, True, wait_for_workers=False,
                          timeout=timedelta(seconds=timeout_s))
    args = dict(port=store.port, prefix=f"tpcoll-{uuid.uuid4().hex}", size=tp, device=device,
                iters=iters, timeout_s=timeout_s,
                plans={k: [[op.kind, list(op.shape), op.dtype] for op in v]
                       for k, v in plans.items()})
    # plain processes (a CUDA parent cannot fork; multiprocessing's spawn would leave its
    # resource tracker running); each prints one JSON line of results last
    procs = [subprocess.Popen([sys.executable, os.path.abspath(__file__),
                               json.dumps({**args, "rank": r})],
                              stdout=subprocess.PIPE, text=True) for r in range(tp)]
    got: dict[int, Any] = {}
    deadline = time.monotonic() + timeout_s
    try:
        while any(p.poll() is None for p in procs):
            bad = [r for r, p in enumerate(procs) if p.returncode not in (None, 0)]
            if bad:  # the others would wait for it in their next collective
                raise RuntimeError(f"collective rank {bad[0]} exited with code "
                                   f"{procs[bad[0]].returncode} (its error is above)")
            if time.monotonic() > deadline:
                raise RuntimeError(f"collective ranks still running after {timeout_s:.0f} s")
            time.sleep(0.1)
        for r, p in enumerate(procs):
            assert p.stdout is not None
            lines = p.stdout.read().strip().splitlines()
            if p.returncode != 0 or not lines:
                raise RuntimeError(f"collective rank {r} exited with code {p.returncode} "
                                   "(its error is above)")
            got[r] = json.loads(lines[-1])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
            if p.stdout is not None:
                p.stdout.close()
    summary = {}
    for name, ops in plans.items():
        summary[name] = {"ms": round(max(got[r][name]["ms"] for r in got), 4),
                         "graph": all(got[r][name]["graph"] for r in got), "ops": len(ops),
                         "mib": round(sum(op.nbytes for op in ops) / 2**20, 2)}
    return summary


def _run_rank(a: dict[str, Any]) -> dict[str, dict[str, Any]]:
    import torch
    import torch.distributed as dist

    from engine.parallel.group import TPGroup

    rank = a["rank"]
    cuda = a["device"].startswith("cuda")
    device = torch.device(f"cuda:{rank}" if cuda else "cpu")
    if cuda:
        torch.cuda.set_device(device)
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", a["port"], a["size"], False,
                          timeout=timedelta(seconds=a["timeout_s"]))
    group = TPGroup(dist.PrefixStore(a["prefix"], store), rank, a["size"], device,
                    a["timeout_s"])
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    out: dict[str, dict[str, Any]] = {}
    for name, raw in a["plans"].items():
        ops = [Collective(kind, tuple(shape), dtype) for kind, shape, dtype in raw]
        bufs = {(op.shape, op.dtype): torch.ones(op.shape, dtype=getattr(torch, op.dtype),
                                                 device=device) for op in ops}

        def one_pass(ops: list[Collective] = ops, bufs: dict = bufs) -> None:
            for op in ops:
                x = bufs[(op.shape, op.dtype)]
                if op.kind == "all_reduce":
                    group.all_reduce(x)
                elif op.kind == "all_gather":
                    group.all_gather_cat(x)
                else:
                    group.broadcast(x, 0)

        for _ in range(3):  # communicators, allocator, first-call costs
            one_pass()
        sync()
        replay = one_pass
        graph_ok = False
        if cuda:
            graph, err = _capture(one_pass)
            # every rank must replay or every rank run eagerly: a mix would pair a graph's
            # collectives with eager ones, so the ranks agree through the store first
            store.set(f"{a['prefix']}/{name}/cap{rank}", "1" if graph is not None else "0")
            flags = [store.get(f"{a['prefix']}/{name}/cap{r}") for r in range(a["size"])]
            if all(f == b"1" for f in flags):
                assert graph is not None
                replay, graph_ok = graph.replay, True
                replay()
            elif err:
                print(f"collectives rank {rank}: no CUDA graph for {name} ({err})",
                      file=sys.stderr, flush=True)
        group.all_reduce(torch.zeros(1, device=device))  # start together
        sync()
        t0 = time.perf_counter()
        for _ in range(a["iters"]):
            replay()
        sync()
        ms = (time.perf_counter() - t0) / a["iters"] * 1e3
        out[name] = {"ms": ms, "graph": graph_ok}
        del replay, bufs
        if cuda:
            torch.cuda.empty_cache()
    return out


def _capture(fn: Any) -> tuple[Any, str]:
    """(graph, "") with fn captured, or (None, why) when capture failed."""
    import torch

    from bench.decode_bench import capture

    try:
        return capture(fn), ""
    except Exception as e:  # noqa: BLE001 - reported, and the eager pass is timed instead
        torch.cuda.synchronize()
        return None, f"{type(e).__name__}: {e}"


if __name__ == "__main__":
    print(json.dumps(_run_rank(json.loads(sys.argv[1]))), flush=True)
