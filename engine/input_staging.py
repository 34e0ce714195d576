"""Pinned host staging for a decode step's inputs: filled by the host, copied to the device
asynchronously, double-buffered so the host fills one while the last copy may still read
the other."""

from __future__ import annotations

import numpy as np
import torch

ROWS = 5  # input ids, positions, slots, sequence lengths, row of the previous step (-1: none)


class DecodeStaging:
    def __init__(self, max_batch: int, max_blocks: int, device: torch.device) -> None:
        pin = device.type == "cuda"
        self.device = device
        self._ints = [torch.zeros(ROWS, max_batch, dtype=torch.int64, pin_memory=pin)
                      for _ in range(2)]
        # flat: a step's [n, width] table is packed contiguously, so one plain copy moves it
        self._tables = [torch.zeros(max_batch * max_blocks, dtype=torch.int32, pin_memory=pin)
                        for _ in range(2)]
        self._done: list[torch.cuda.Event | None] = [None, None]
        self._slot = 0

    def begin(self) -> np.ndarray:
        """The next ints [5, N] numpy view to fill; waits only if the copy that last read
        this slot has not run yet (it ran long ago unless the device lags far behind)."""
        self._slot ^= 1
        ev = self._done[self._slot]
        if ev is not None:
            ev.synchronize()
        return self._ints[self._slot].numpy()

    def table(self, n: int, width: int) -> np.ndarray:
        """This slot's [n, width] block-table view (zeroed), packed contiguously."""
        t = self._tables[self._slot][: n * width].numpy().reshape(n, width)
        t.fill(0)
        return t

    def upload(self, n: int, width: int, ids: torch.Tensor, pos: torch.Tensor,
               slots: torch.Tensor, seq_lens: torch.Tensor, tables: torch.Tensor
               ) -> torch.Tensor:
        """Copies the first n rows (and width table columns) into the given device buffers;
        returns the device copy of the previous-step rows [n] int64."""
        dev = self._ints[self._slot].to(self.device, non_blocking=True)[:, :n]  # one copy
        ids[:n].copy_(dev[0])
        pos[:n].copy_(dev[1])
        slots[:n].copy_(dev[2])
        seq_lens[:n].copy_(dev[3])
        if width:
            t = self._tables[self._slot][: n * width].view(n, width)
            tables[:n, :width].copy_(t.to(self.device, non_blocking=True))
        if self.device.type == "cuda":
            ev = torch.cuda.Event()
            ev.record()
            self._done[self._slot] = ev
        return dev[4]
