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

HOST_STAGED = "tp_host_staged"  # EngineConfig.extra key: CUDA ranks share one GPU


def host_staged(extra: dict[str, Any]) -> bool:
    """Whether an engine's config asks for host-staged collectives (TPGroup)."""
    return bool(extra.get(HOST_STAGED))


class TPGroup:
    def __init__(self, store: dist.Store, rank: int, size: int, device: torch.device,
                 timeout_s: float, host_staged: bool = False) -> None:
        """host_staged: CUDA ranks that share one GPU (NCCL refuses two ranks on one
        device; benchmarks run a two-rank layout on one GPU that way): gloo, every
        collective copied through host memory. Slow, never captured in a CUDA graph."""
        self.rank, self.size, self.device = rank, size, device
        self.timeout_s = timeout_s
        self.host_staged = host_staged and device.type == "cuda"
        timeout = timedelta(seconds=timeout_s)
        if device.type == "cuda" and not self.host_staged:
            opts = dist.ProcessGroupNCCL.Options()
            opts._timeout = timeout
            # Any: torch's stubs lack the backends' collective methods
            self.pg: Any = dist.ProcessGroupNCCL(store, rank, size, opts)
        else:
            self.pg = dist.ProcessGroupGloo(store, rank, size, timeout)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum over ranks, in place; returns x."""
        h = self._host(x)
        self.pg.allreduce([h]).wait()
        return self._back(x, h)

    def all_gather_cat(self, x: torch.Tensor) -> torch.Tensor:
        """[..., n] per rank -> [..., size * n], rank order along the last dim."""
        h = self._host(x.contiguous())
        outs = [torch.empty_like(h) for _ in range(self.size)]
        self.pg.allgather([outs], [h]).wait()
        return torch.cat(outs, dim=-1).to(x.device)

    def broadcast(self, x: torch.Tensor, root: int = 0) -> torch.Tensor:
        h = self._host(x)
        self.pg.broadcast(h, root).wait()
        return self._back(x, h)

    def all_gather_rows(self, x: torch.Tensor) -> torch.Tensor:
        """[m, ...] per rank (the same m on every rank) -> [size * m, ...], rank-major."""
        h = self._host(x.contiguous())
        out = h.new_empty(self.size * h.shape[0], *h.shape[1:])
        self.pg._allgather_base(out, h).wait()
        return out.to(x.device)

    def reduce_scatter_rows(self, y: torch.Tensor) -> torch.Tensor:
        """[size * m, ...] per rank -> [m, ...]: rank r's rows summed over the ranks."""
        h = self._host(y.contiguous())
        out = h.new_empty(h.shape[0] // self.size, *h.shape[1:])
        self.pg._reduce_scatter_base(out, h).wait()
        return out.to(y.device)

    def gather_to_0(self, x: torch.Tensor) -> list[torch.Tensor] | None:
        """Every rank's x (same shape everywhere) at rank 0, in rank order; None elsewhere."""
        h = self._host(x.contiguous())
        opts = dist.GatherOptions()
        opts.rootRank = 0
        if self.rank != 0:
            self.pg.gather([], [h], opts).wait()
            return None
        outs = [torch.empty_like(h) for _ in range(self.size)]
        self.pg.gather([outs], [h], opts).wait()
        return [o.to(x.device) for o in outs]

    def _host(self, x: torch.Tensor) -> torch.Tensor:
        return x.cpu() if self.host_staged else x

    def _back(self, x: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        if h is not x:
            x.copy_(h)
        return x

    def abort(self) -> None:
        """Tears the communicator down from any thread, so collectives that wait for a dead
        peer end (with an error) instead of spinning. Collectives captured in a CUDA graph
        are outside the group's timeout watchdog: this is what ends them."""
        fn = getattr(self.pg, "abort", None) or getattr(self.pg, "_abort", None)
        if fn is not None:
            fn()
