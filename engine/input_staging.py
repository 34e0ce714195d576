"""Pinned host staging for a graph step's inputs (decode, and short prefill): filled by the
host, copied to the device asynchronously, double-buffered so the host fills one while the
last copy may still read the other.

Block tables are mirrored: the device table keeps every row from earlier steps, and a step
uploads only the entries that changed (a request's new block, or rows whose request
changed), so a steady decode batch moves a few bytes of table per step, not B x W.
"""

from __future__ import annotations

import numpy as np
import torch

from engine.decode_graphs import INT_ROWS
from engine.prefill_graphs import input_words, prefill_inputs
from engine.request import Request


class DecodeStaging:
    def __init__(self, max_batch: int, max_blocks: int, device: torch.device) -> None:
        pin = device.type == "cuda"
        self.device = device
        self.max_blocks = max_blocks
        self._ints = [torch.zeros(INT_ROWS, max_batch, dtype=torch.int64, pin_memory=pin)
                      for _ in range(2)]
        self._temps = [torch.zeros(max_batch, dtype=torch.float32, pin_memory=pin)
                       for _ in range(2)]
        # table changes: flat indices into the device table in [:K], block ids in [K:2K]
        cap = max_batch * max_blocks
        self._edits = [torch.zeros(2 * cap, dtype=torch.int64, pin_memory=pin)
                       for _ in range(2)]
        self._vals = np.zeros(cap, dtype=np.int64)
        self._num_edits = 0
        self._done: list[torch.cuda.Event | None] = [None, None]
        self._slot = 0
        # what each device table row holds: (the block list it was copied from, its length
        # then). The mirror holds the list itself, so its id cannot be reused meanwhile.
        self._rows: list[tuple[list[int] | None, int]] = [(None, 0)] * max_batch

    def begin(self) -> tuple[np.ndarray, np.ndarray]:
        """The next ints [INT_ROWS, N] and temperatures [N] numpy views to fill; waits only
        if the copy that last read this slot has not run yet (it ran long ago unless the
        device lags far behind)."""
        self._slot ^= 1
        ev = self._done[self._slot]
        if ev is not None:
            ev.synchronize()
        self._num_edits = 0
        return self._ints[self._slot].numpy(), self._temps[self._slot].numpy()

    def invalidate_tables(self) -> None:
        """Forget what the device table holds (its rows are rewritten on next use)."""
        self._rows = [(None, 0)] * len(self._rows)

    def table_row(self, row: int, block_ids: list[int]) -> None:
        """Row ``row`` of the device table must hold ``block_ids``. A request's block list
        only ever grows in place (extend); freeing or reallocating assigns a new list, so
        the same list object with at least as many entries has the same prefix."""
        have_list, have = self._rows[row]
        n = len(block_ids)
        start = have if have_list is block_ids and have <= n else 0
        if start == n:
            return
        k = self._num_edits
        base = row * self.max_blocks
        self._edits[self._slot].numpy()[k:k + n - start] = np.arange(base + start, base + n)
        self._vals[k:k + n - start] = block_ids[start:]
        self._num_edits = k + n - start
        self._rows[row] = (block_ids, n)

    def pending_edits(self) -> tuple[np.ndarray, np.ndarray]:
        """Copies of this step's table edits (flat indices, block ids): what a tensor-
        parallel follower applies to its own table to keep it equal to this one."""
        k = self._num_edits
        return self._edits[self._slot].numpy()[:k].copy(), self._vals[:k].copy()

    def upload(self, ints: torch.Tensor, temperature: torch.Tensor,
               tables: torch.Tensor) -> None:
        """Copies the staged ints and temperatures, and applies the table edits."""
        ints.copy_(self._ints[self._slot], non_blocking=True)
        temperature.copy_(self._temps[self._slot], non_blocking=True)
        k = self._num_edits
        if k:
            host = self._edits[self._slot]
            host.numpy()[k:2 * k] = self._vals[:k]
            e = host[:2 * k].to(self.device, non_blocking=True)  # one copy
            tables.view(-1)[e[:k]] = e[k:].to(tables.dtype)
        if self.device.type == "cuda":
            ev = torch.cuda.Event()
            ev.record()
            self._done[self._slot] = ev


class PrefillStaging:
    """A prefill graph step's inputs in pinned host memory, laid out as the device buffer
    (engine/prefill_graphs.PrefillInputs), so one copy moves them all; double-buffered as
    DecodeStaging is. The block table row is written whole every step: a prefill step is
    a request's first or one of few, so there is no earlier row to reuse."""

    def __init__(self, max_tokens: int, max_blocks: int, block_size: int,
                 device: torch.device) -> None:
        pin = device.type == "cuda"
        self.device = device
        self.block_size = block_size
        self._host = [prefill_inputs(torch.zeros(input_words(max_tokens, max_blocks),
                                                 dtype=torch.int64, pin_memory=pin),
                                     max_tokens, max_blocks) for _ in range(2)]
        self._done: list[torch.cuda.Event | None] = [None, None]
        self._slot = 0

    def stage(self, r: Request, start: int, n: int, bucket: int) -> None:
        """Writes the chunk of ``n`` tokens of ``r`` from position ``start``, padded to
        ``bucket`` rows; waits only if the copy that last read this slot has not run."""
        self._slot ^= 1
        ev = self._done[self._slot]
        if ev is not None:
            ev.synchronize()
        h = self._host[self._slot]
        ids, pos, slots = h.input_ids.numpy(), h.positions.numpy(), h.slot_mapping.numpy()
        table = h.block_table.numpy()[0]
        np_ = r.num_prompt_tokens
        end = start + n
        ids[:n] = r.prompt_token_ids[start:end] if end <= np_ else \
            r.prompt_token_ids[start:] + r.output_token_ids[max(start - np_, 0):end - np_]
        p = np.arange(start, end, dtype=np.int64)
        pos[:n] = p
        table[:len(r.block_ids)] = r.block_ids
        bs = self.block_size
        slots[:n] = table[p // bs].astype(np.int64) * bs + p % bs
        ids[n:bucket] = 0
        pos[n:bucket] = 0
        slots[n:bucket] = -1  # padding rows store no KV
        h.last.numpy()[0] = n - 1
        h.seq_lens.numpy()[0] = end
        h.cu_seqlens_q.numpy()[:] = (0, n)

    def upload(self, ints: torch.Tensor) -> None:
        """Copies the staged step into the device buffer ``ints`` (PrefillInputs.ints)."""
        ints.copy_(self._host[self._slot].ints, non_blocking=True)
        if self.device.type == "cuda":
            ev = torch.cuda.Event()
            ev.record()
            self._done[self._slot] = ev
