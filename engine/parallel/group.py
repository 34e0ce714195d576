"""The collectives of one engine's tensor-parallel ranks.

Built on a process group of our own (not torch.distributed's global default), keyed by a
per-engine store prefix, so several engines can live in one process (tests) and nothing
else in the process is affected. Gloo on CPU, NCCL on CUDA. Every collective is issued in
the same order on every rank: that order is the model's forward, then the sampled-id
broadcast, so the ranks can never pair up different operations.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist


class TPGroup:
    def __init__(self, store: dist.Store, rank: int, size: int, device: torch.device,
                 timeout_s: float) -> None:
        self.rank, self.size, self.device = rank, size, device
        self.timeout_s = timeout_s
        timeout = timedelta(seconds=timeout_s)
        if device.type == "cuda":
            opts = dist.ProcessGroupNCCL.Options()
            opts._timeout = timeout
            # Any: torch's stubs lack the backends' collective methods
            self.pg: Any = dist.ProcessGroupNCCL(store, rank, size, opts)
        else:
            self.pg = dist.ProcessGroupGloo(store, rank, size, timeout)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum over ranks, in place; returns x."""
        self.pg.allreduce([x]).wait()
        return x

    def all_gather_cat(self, x: torch.Tensor) -> torch.Tensor:
        """[..., n] per rank -> [..., size * n], rank order along the last dim."""
        outs = [torch.empty_like(x) for _ in range(self.size)]
        self.pg.allgather([outs], [x.contiguous()]).wait()
        return torch.cat(outs, dim=-1)

    def broadcast(self, x: torch.Tensor, root: int = 0) -> torch.Tensor:
        self.pg.broadcast(x, root).wait()
        return x

    def abort(self) -> None:
        """Tears the communicator down from any thread, so collectives that wait for a dead
        peer end (with an error) instead of spinning. Collectives captured in a CUDA graph
        are outside the group's timeout watchdog: this is what ends them."""
        fn = getattr(self.pg, "abort", None) or getattr(self.pg, "_abort", None)
        if fn is not None:
            fn()
