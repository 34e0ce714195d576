"""A batch's allowed-token bitmask, built on the host while the device runs the forward.

Deferred output launches step N+1 before the host has read step N's tokens, yet step N+1's
mask depends on them. The runner calls ``bitmask`` after it has launched the forward (eager
or graph replay): reading step N's ids then waits for step N alone, which finished behind
nothing, and the matchers advance and fill the mask while step N+1's forward runs. Only the
finished mask crosses to the device, and it is applied to the logits after the graphed
forward, so no CUDA graph changes.

Layout: int32 words, bit ``t % 32`` of word ``t // 32`` set when token t is allowed (the
layout llguidance and xgrammar write); rows of requests without a grammar are all ones.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from engine.request import PLACEHOLDER, Request

if TYPE_CHECKING:
    import llguidance


def words_for(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


class GrammarMasks:
    def __init__(self, vocab_size: int, eos_ids: list[int], device: torch.device) -> None:
        self.vocab = vocab_size
        self.words = words_for(vocab_size)
        self.device = device
        self.eos_ids = eos_ids
        # the words holding EOS bits, and each word with those bits cleared (numpy: a few
        # rows' edits cost microseconds, where per-element tensor ops cost that per bit)
        words = sorted({t // 32 for t in eos_ids})
        keep = [~sum(_bit(t % 32) for t in eos_ids if t // 32 == w) for w in words]
        self._eos_words = np.array(words, dtype=np.int64)
        self._eos_keep = np.array(keep, dtype=np.int64).astype(np.int32)
        self._executor: llguidance.LLExecutor | None = None
        # Two pinned buffers used in turn: a copy queued from one may still be running while
        # the next step fills the other; `_done[i]` marks when buffer i's copy has been made.
        self._host: list[torch.Tensor] = []
        self._done: list[torch.cuda.Event | None] = [None, None]
        self._turn = 0
        self.host_s = 0.0  # host time spent building masks, in all (benchmarks read it)

    def _buffer(self, rows: int) -> torch.Tensor:
        i = self._turn = 1 - self._turn
        if len(self._host) < 2 or self._host[i].shape[0] < rows:
            pin = self.device.type == "cuda"
            size = max(rows, 64)
            self._host = [torch.empty((size, self.words), dtype=torch.int32, pin_memory=pin)
                          for _ in range(2)]
            self._done = [None, None]
        ev = self._done[i]
        if ev is not None:
            ev.synchronize()  # queued a step ago: long done
        return self._host[i][:rows]

    def bitmask(self, reqs: list[Request],
                prev_token: Callable[[Request], int] | None) -> torch.Tensor | None:
        """[len(reqs), words] int32 on the device, or None when no row has a grammar.
        prev_token(r): the id the previous (unread) step sampled for r, read on demand."""
        rows = [(i, r) for i, r in enumerate(reqs) if r.grammar is not None]
        if not rows:
            return None
        t0 = time.perf_counter()
        try:
            return self._build(reqs, rows, prev_token)
        finally:
            self.host_s += time.perf_counter() - t0

    def _build(self, reqs: list[Request], rows: list[tuple[int, Request]],
               prev_token: Callable[[Request], int] | None) -> torch.Tensor:
        for _, r in rows:
            catch_up(r, prev_token)
        host = self._buffer(len(reqs))
        host.fill_(-1)
        live: list[tuple[Any, int]] = []
        for i, r in rows:
            assert r.grammar is not None
            if r.grammar.failed:  # a rejected token: only EOS, so the request ends
                self._only_eos(host[i])
            else:
                live.append((r.grammar.matcher, i))
        if live:
            self._fill(live, host)
            # An EOS id ends the request here, whatever the grammar thinks of it: a model
            # whose EOS is also an ordinary token (a byte, a word) must not stop mid-grammar.
            busy = [i for m, i in live if not m.is_accepting()]
            if busy:
                view = host.numpy()
                view[np.ix_(np.array(busy, dtype=np.int64), self._eos_words)] &= self._eos_keep
        if self.device.type != "cuda":
            return host.clone()
        dev = host.to(self.device, non_blocking=True)
        ev = torch.cuda.Event()
        ev.record()
        self._done[self._turn] = ev
        return dev

    def _fill(self, live: list[tuple[Any, int]], host: torch.Tensor) -> None:
        ptr, row_bytes = host.data_ptr(), self.words * 4
        if len(live) == 1:
            m, i = live[0]
            m.unsafe_compute_mask_ptr(ptr + i * row_bytes, row_bytes)
            return
        if self._executor is None:
            import llguidance

            self._executor = llguidance.LLExecutor()
        self._executor.unsafe_compute_mask_ptr(live, ptr, row_bytes, host.shape[0])

    def _only_eos(self, row: torch.Tensor) -> None:
        row.zero_()
        for t in self.eos_ids:
            row[t // 32] |= _bit(t % 32)


def _bit(b: int) -> int:
    return (1 << b) - (1 << 32) if b == 31 else 1 << b  # int32's sign bit


def catch_up(r: Request, prev_token: Callable[[Request], int] | None) -> None:
    """Feeds r's grammar the output tokens it has not taken: token 0 and the prior outputs
    of a request resumed on this node, then one token per step. A placeholder (the previous
    step's unread sample) is read through prev_token."""
    g = r.grammar
    assert g is not None
    out = r.output_token_ids
    while g.num_accepted < len(out):
        t = out[g.num_accepted]
        if t == PLACEHOLDER:
            assert prev_token is not None, "a placeholder without a previous step"
            t = prev_token(r)
        g.accept(t)
