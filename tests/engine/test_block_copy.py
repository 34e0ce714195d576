"""engine/parallel/block_copy.py across two real ranks (two processes, one TPGroup): the
first rank's named KV blocks land byte for byte in the same blocks of the other rank, no
other block of either pool changes, for every KV dtype (float8 and bfloat16 travel as
bytes). On CPU over gloo; with two GPUs over NCCL (``-m gpu``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

RANK = r"""
import os
import sys
from datetime import timedelta

import torch
import torch.distributed as dist
from engine.parallel.block_copy import broadcast_blocks
from engine.parallel.group import TPGroup

rank, port, device, dtype = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
dev = torch.device(device if device == "cpu" else f"cuda:{rank}")
if dev.type == "cuda":
    torch.cuda.set_device(dev)
store = dist.TCPStore("127.0.0.1", port, 2, rank == 0, timeout=timedelta(seconds=60))
group = TPGroup(dist.PrefixStore("copy", store), rank, 2, dev, 60.0)
shape = (12, 2, 1, 4, 1, 48)  # [NB, layers, 1 (a latent), block_size, 1, latent width]
g = torch.Generator().manual_seed(7)
full = (torch.randn(shape, generator=g) * 3).to(getattr(torch, dtype))
blank = torch.full(shape, -1.0).to(getattr(torch, dtype))
ids = [9, 2, 3, 7]
kv = (full if rank == 0 else blank).clone().to(dev)
broadcast_blocks(group, kv, ids)
got = kv.cpu().view(torch.uint8)
want = (full if rank == 0 else blank).view(torch.uint8).clone()
want[ids] = full.view(torch.uint8)[ids]
assert torch.equal(got, want), f"rank {rank}: blocks differ"
assert not torch.equal(want, blank.view(torch.uint8))
broadcast_blocks(group, kv, [])  # nothing to copy: no collective, no hang
print("ok", rank, flush=True)
# Rank 0 holds the store: it leaves only after rank 1 is done with it, and neither runs the
# C++ teardown, where a rank whose peer had gone died in gloo's threads ("terminate called
# without an active exception", seen once in a whole-suite run).
if rank == 0:
    store.wait(["rank1_done"])
else:
    store.set("rank1_done", "1")
os._exit(0)
"""


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _run(device: str, dtype: str) -> None:
    port = _free_port()
    env = dict(os.environ, PYTHONPATH=ROOT)
    procs = [subprocess.Popen([sys.executable, "-c", RANK, str(r), str(port), device, dtype],
                              cwd=ROOT, env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for r in (0, 1)]
    outs = []
    for p in procs:
        try:
            out, _ = p.communicate(timeout=120)
        finally:
            if p.poll() is None:
                p.kill()
                p.wait()
        outs.append(out)
    for r, (p, out) in enumerate(zip(procs, outs, strict=True)):
        assert p.returncode == 0 and f"ok {r}" in out, out
    if os.environ.get("OUT"):  # the lead's record of a GPU run
        with open(os.path.join(os.environ["OUT"], f"block_copy_{device}_{dtype}.json"),
                  "w") as f:
            json.dump({"device": device, "dtype": dtype, "ranks": 2, "blocks_equal": True}, f)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float8_e4m3fn"])
def test_blocks_copy_from_the_first_rank_over_gloo(dtype: str) -> None:
    _run("cpu", dtype)


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")
@pytest.mark.parametrize("dtype", ["bfloat16", "float8_e4m3fn"])
def test_blocks_copy_from_the_first_rank_over_nccl(dtype: str) -> None:
    _run("cuda", dtype)
