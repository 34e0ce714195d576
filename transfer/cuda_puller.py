"""How the ipc plane pulls an announce's runs from a producer GPU: DMA or one kernel.

Default (``PDSERVE_IPC_COPY=dma``): one ``cuMemcpyDtoDAsync`` per run on the copy engine;
it reaches the link's peak on large runs and leaves the SMs to the consumer's decode.
``kernel``: every block of the announce in one Triton launch over NVLink; ``auto``: the
kernel for announces of many short runs. Measured on 2x H200 (bench/RESULTS.md), the
kernel lost to DMA even for scattered 2 MiB blocks (Llama-3-8B, 16 requests in flight:
138 vs 216 GB/s), so it stays opt-in, for other GPUs and links to try.
"""

from __future__ import annotations

import os
from typing import Any

from transfer import cuda_driver

KERNEL_BELOW = 16 << 20  # mean run bytes under which a multi-run announce uses the kernel


class _Words:
    """The address of a pool as int64 words, for a Triton launch (a peer's has no tensor)."""

    dtype: Any

    def __init__(self, ptr: int) -> None:
        import torch

        self.ptr, self.dtype = ptr, torch.int64

    def data_ptr(self) -> int:
        return self.ptr


class CudaPuller:
    def __init__(self, stream: Any, local_base: int, block_nbytes: int) -> None:
        self.stream = stream
        self.local_base = local_base
        self.block_nbytes = block_nbytes
        self.mode = os.environ.get("PDSERVE_IPC_COPY", "dma")
        if self.mode not in ("dma", "kernel", "auto"):
            raise ValueError(f"PDSERVE_IPC_COPY: expected dma, kernel or auto, got {self.mode!r}")
        self._runs: list[tuple[int, int, int, int]] = []  # (peer base, src blk, dst blk, n)
        if self.mode != "dma" and block_nbytes % 8 == 0:
            self._warm_up()

    def add(self, peer_ptr: int, src_block: int, dst_block: int, num_blocks: int) -> None:
        self._runs.append((peer_ptr, src_block, dst_block, num_blocks))

    def issue(self) -> None:
        """Enqueues every added run on the stream."""
        runs, self._runs = self._runs, []
        if not runs:
            return
        blocks = sum(r[3] for r in runs)
        use_kernel = self.block_nbytes % 8 == 0 and (
            self.mode == "kernel" or (self.mode == "auto" and len(runs) > 1
                                      and blocks * self.block_nbytes < KERNEL_BELOW * len(runs)))
        if not use_kernel:
            bn = self.block_nbytes
            for peer, s, d, n in runs:
                cuda_driver.copy_async(self.local_base + d * bn, peer + s * bn, n * bn,
                                       self.stream.cuda_stream)
            return
        for peer in {r[0] for r in runs}:  # one launch per producer (one, from one announce)
            src = [s + i for p, s, _, n in runs if p == peer for i in range(n)]
            dst = [d + i for p, _, d, n in runs if p == peer for i in range(n)]
            self._launch(peer, src, dst)

    def _launch(self, peer: int, src: list[int], dst: list[int]) -> None:
        import torch

        from kernels.triton_blocks import copy_block_pairs

        with torch.cuda.stream(self.stream):  # Triton launches on the current stream
            ids = torch.tensor([src, dst], dtype=torch.int64).to(self.stream.device,
                                                                  non_blocking=True)
            copy_block_pairs(_Words(peer), _Words(self.local_base), ids, self.block_nbytes // 8)

    def _warm_up(self) -> None:
        # compiles the kernel now, not on the first request's critical path
        import torch

        scratch = torch.zeros(2, self.block_nbytes // 8, dtype=torch.int64,
                              device=self.stream.device)
        base = scratch.data_ptr()
        with torch.cuda.stream(self.stream):
            from kernels.triton_blocks import copy_block_pairs

            ids = torch.tensor([[0], [1]], dtype=torch.int64, device=self.stream.device)
            copy_block_pairs(_Words(base), _Words(base), ids, self.block_nbytes // 8)
        self.stream.synchronize()
