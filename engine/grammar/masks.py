"""A batch's allowed-token bitmask, built on the host while the device runs the forward.

Deferred output launches step N+1 before the host has read step N's tokens, yet step N+1's
mask depends on them. Two paths build it, neither of which touches a CUDA graph (only the
finished mask crosses to the device, applied to the logits after the graphed forward):

- ahead (CUDA): right after step N's sampler is launched, the runner hands its sampled ids
  to ``ahead``, which queues one job on a mask thread: wait for those ids alone, advance each
  grammar by its token, fill its row. The job runs while the engine thread reads step N-1's
  outputs, schedules and launches step N+1's forward, so none of that waits for it, and the
  mask work starts as soon as the tokens exist instead of after that host work. llguidance
  releases the GIL for the mask fill, the job's long part.
- in step (every device, and a request the job did not cover: new, resumed, preempted): the
  runner calls ``bitmask`` after it has launched the forward (eager or graph replay); reading
  step N's ids then waits for step N alone, and the matchers advance and fill the mask while
  step N+1's forward runs.

Per-step host time is kept by phase in ``times`` (benchmarks read it): read (waiting for
and reading the previous step's ids), advance, mask (llguidance), copy (rows without a
live grammar, EOS edits, the host->device copy); join (the engine thread waiting for the
ahead job) and ahead_read / ahead_advance / ahead_mask (the job, on the mask thread). No
torch kernel runs on the host buffers: a torch fill or clone of a [32, 4008] buffer wakes
torch's CPU thread pool, which stalls for milliseconds when llguidance's threads hold the
cores.

Layout: int32 words, bit ``t % 32`` of word ``t // 32`` set when token t is allowed (the
layout llguidance and xgrammar write); rows of requests without a grammar are all ones.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from engine.grammar.matcher import RequestGrammar
from engine.request import PLACEHOLDER, Request

if TYPE_CHECKING:
    import llguidance

PHASES = ("read", "advance", "mask", "copy", "join", "ahead_read", "ahead_advance",
          "ahead_mask")


def words_for(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


@dataclass
class _Ahead:
    """An ahead job's result: row j of `rows` is the mask of grammars[j] (held, so no other
    grammar can take its id) after it has taken `taken[j]` tokens."""

    index: dict[int, int]  # id(grammar) -> j
    grammars: list[RequestGrammar]
    taken: list[int]
    rows: np.ndarray


class GrammarMasks:
    def __init__(self, vocab_size: int, eos_ids: list[int], device: torch.device,
                 threads: int | None = None, ahead: bool | None = None) -> None:
        """threads: llguidance's worker threads (None: default_threads()).
        ahead: build next step's masks on a mask thread (None: on CUDA only; a CPU forward
        has no idle host cores to give it)."""
        self.vocab = vocab_size
        self.words = words_for(vocab_size)
        self.device = device
        self.eos_ids = eos_ids
        self.ahead_enabled = device.type == "cuda" if ahead is None else ahead
        # the words holding EOS bits, and each word with those bits cleared (numpy: a few
        # rows' edits cost microseconds, where per-element tensor ops cost that per bit)
        words = sorted({t // 32 for t in eos_ids})
        keep = [~sum(_bit(t % 32) for t in eos_ids if t // 32 == w) for w in words]
        self._eos_words = np.array(words, dtype=np.int64)
        self._eos_keep = np.array(keep, dtype=np.int64).astype(np.int32)
        self._eos_only = np.zeros(self.words, dtype=np.int32)
        for t in eos_ids:
            self._eos_only[t // 32] |= np.int32(_bit(t % 32))
        self._threads = threads
        self._executor: llguidance.LLExecutor | None = None
        # Two pinned buffers used in turn: a copy queued from one may still be running while
        # the next step fills the other; `_done[i]` marks when buffer i's copy has been made.
        self._host: list[torch.Tensor] = []
        self._views: list[np.ndarray] = []  # numpy views of _host (no per-step conversion)
        self._done: list[torch.cuda.Event | None] = [None, None]
        self._turn = 0
        # the ahead job: one at a time, its rows written into one buffer it reuses
        self._pool: ThreadPoolExecutor | None = None
        self._job: Future[_Ahead] | None = None
        self._done_job: _Ahead | None = None  # a job wait() finished, for the next bitmask
        self._ahead_rows = np.zeros((0, self.words), dtype=np.int32)
        self.host_s = 0.0  # engine-thread time spent in bitmask, in all (benchmarks read it)
        self.times = dict.fromkeys(PHASES, 0.0)  # host time by phase, in all
        self.rows_ahead = 0  # rows whose mask the ahead job made (tests and benchmarks)
        self.rows_in_step = 0  # ... and rows made in the step

    def executor(self) -> llguidance.LLExecutor:
        if self._executor is None:
            import llguidance

            self._executor = llguidance.LLExecutor(self._threads or default_threads())
        return self._executor

    def close(self) -> None:
        self._join()
        if self._pool is not None:
            self._pool.shutdown()
            self._pool = None

    # -- ahead: next step's masks on the mask thread -------------------------------------

    def ahead(self, reqs: list[Request], sampled: torch.Tensor) -> None:
        """Queues next step's masks for reqs, this step's sampling rows in order; sampled:
        their ids on the device (this step's sampler output, just launched)."""
        self._join()  # one job at a time: its grammars are the next one's
        if not self.ahead_enabled or sampled.shape[0] != len(reqs):  # nothing sampled
            return
        rows = [(i, r.grammar) for i, r in enumerate(reqs) if r.grammar is not None
                and r.grammar.num_accepted == len(r.output_token_ids) and _continues(r)]
        if not rows:
            return
        host, ready = sampled, None
        if sampled.is_cuda:
            host = sampled.to("cpu", non_blocking=True)
            ready = torch.cuda.Event()
            ready.record()
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="grammar-masks")
        self._job = self._pool.submit(self._ahead_job, rows, host, ready)

    def _ahead_job(self, rows: list[tuple[int, RequestGrammar]], host: torch.Tensor,
                   ready: torch.cuda.Event | None) -> _Ahead:
        t0 = time.perf_counter()
        if ready is not None:
            ready.synchronize()  # this step's ids alone (the GIL is released meanwhile)
        ids = host.tolist()
        t1 = self._lap("ahead_read", t0)
        for i, g in rows:
            g.accept(ids[i])
        t2 = self._lap("ahead_advance", t1)
        if self._ahead_rows.shape[0] < len(rows):
            self._ahead_rows = np.zeros((max(len(rows), 64), self.words), dtype=np.int32)
        buf = self._ahead_rows
        live = []
        for j, (_, g) in enumerate(rows):
            if g.failed:
                buf[j] = self._eos_only
            else:
                live.append((g.matcher, j))
        if live:
            self._fill(live, buf.ctypes.data, buf.shape[0])
            self._keep_eos_out(buf, live)
        self._lap("ahead_mask", t2)
        return _Ahead({id(g): j for j, (_, g) in enumerate(rows)}, [g for _, g in rows],
                      [g.num_accepted for _, g in rows], buf)

    def wait(self) -> None:
        """Lets the ahead job finish. Anything outside a step that reads or changes a
        request's grammar (its error, a benchmark's check) calls this first: the job
        advances and reads the matchers on the mask thread, and llguidance refuses a
        matcher used from two threads at once ("Already mutably borrowed")."""
        done = self._join()
        if done is not None:
            self._done_job = done

    def _join(self) -> _Ahead | None:
        job, self._job = self._job, None
        if job is None:
            done, self._done_job = self._done_job, None
            return done
        return job.result()

    # -- the step's mask ------------------------------------------------------------------

    def _buffer(self, rows: int) -> tuple[torch.Tensor, np.ndarray]:
        i = self._turn = 1 - self._turn
        if len(self._host) < 2 or self._host[i].shape[0] < rows:
            pin = self.device.type == "cuda"
            size = max(rows, 64)
            self._host = [torch.empty((size, self.words), dtype=torch.int32, pin_memory=pin)
                          for _ in range(2)]
            self._views = [h.numpy() for h in self._host]
            self._done = [None, None]
        ev = self._done[i]
        if ev is not None:
            ev.synchronize()  # queued a step ago: long done
        return self._host[i][:rows], self._views[i][:rows]

    def bitmask(self, reqs: list[Request],
                prev_token: Callable[[Request], int] | None) -> torch.Tensor | None:
        """[len(reqs), words] int32 on the device, or None when no row has a grammar.
        prev_token(r): the id the previous (unread) step sampled for r, read on demand."""
        t0 = time.perf_counter()
        pre = self._join()  # it advanced grammars: nothing below may run before it ends
        t1 = self._lap("join", t0)
        rows = [(i, r.grammar) for i, r in enumerate(reqs) if r.grammar is not None]
        try:
            return self._build(reqs, rows, pre, prev_token, t1) if rows else None
        finally:
            self.host_s += time.perf_counter() - t0

    def _build(self, reqs: list[Request], rows: list[tuple[int, RequestGrammar]],
               pre: _Ahead | None, prev_token: Callable[[Request], int] | None,
               t0: float) -> torch.Tensor:
        src: list[int] = []  # rows the ahead job made: its row, and this batch's
        dst: list[int] = []
        todo: list[tuple[int, RequestGrammar]] = []
        for i, g in rows:
            j = pre.index.get(id(g), -1) if pre is not None else -1
            if pre is not None and j >= 0 and pre.grammars[j] is g \
                    and pre.taken[j] == g.num_accepted == len(reqs[i].output_token_ids):
                src.append(j)
                dst.append(i)
            else:
                todo.append((i, g))
        pending = [(g, new_tokens(reqs[i], g, prev_token)) for i, g in todo]
        t1 = self._lap("read", t0)
        for g, toks in pending:
            for t in toks:
                g.accept(t)
        t2 = self._lap("advance", t1)
        host, view = self._buffer(len(reqs))
        live: list[tuple[Any, int]] = []
        for i, g in todo:
            if g.failed:  # a rejected token: only EOS, so the request ends
                view[i] = self._eos_only
            else:
                live.append((g.matcher, i))
        if live:
            self._fill(live, host.data_ptr(), host.shape[0])
        t3 = self._lap("mask", t2)
        if live:
            self._keep_eos_out(view, live)
        if src:
            assert pre is not None
            view[dst] = pre.rows[src]
        if len(rows) < len(reqs):
            has_grammar = np.zeros(len(reqs), dtype=bool)
            has_grammar[[i for i, _ in rows]] = True
            view[~has_grammar] = -1
        self.rows_ahead += len(src)
        self.rows_in_step += len(todo)
        if self.device.type != "cuda":
            out = torch.from_numpy(view.copy())  # numpy: one memcpy, no torch thread pool
        else:
            out = host.to(self.device, non_blocking=True)
            ev = torch.cuda.Event()
            ev.record()
            self._done[self._turn] = ev
        self._lap("copy", t3)
        return out

    # -- shared ---------------------------------------------------------------------------

    def _lap(self, phase: str, since: float) -> float:
        now = time.perf_counter()
        self.times[phase] += now - since
        return now

    def _fill(self, live: list[tuple[Any, int]], ptr: int, batch: int) -> None:
        """Each (matcher, row)'s mask into row `row` of the int32 [batch, words] at ptr."""
        row_bytes = self.words * 4
        if len(live) == 1:
            m, i = live[0]
            m.unsafe_compute_mask_ptr(ptr + i * row_bytes, row_bytes)
            return
        self.executor().unsafe_compute_mask_ptr(live, ptr, row_bytes, batch)

    def _keep_eos_out(self, view: np.ndarray, live: list[tuple[Any, int]]) -> None:
        """An EOS id ends the request here, whatever the grammar thinks of it: a model whose
        EOS is also an ordinary token (a byte, a word) must not stop mid-grammar."""
        busy = [i for m, i in live if not m.is_accepting()]
        if busy:
            view[np.ix_(np.array(busy, dtype=np.int64), self._eos_words)] &= self._eos_keep


def _continues(r: Request) -> bool:
    """Whether r may sample again after this step's token (which is not counted yet): not a
    producer's request (it leaves after token 0), not one at its max_tokens."""
    return not r.prefill_only and len(r.output_token_ids) + 1 < r.params.max_tokens


def default_threads() -> int:
    """Half this process's CPUs, at most 8, where llguidance would take 80% (12 of 16): a
    step's mask is bound by its slowest row (one row near a bounded string's end walks the
    whole vocabulary, bench/RESULTS.md), which no thread count splits, while the engine
    thread, the mask thread, the CUDA driver's threads and torch's CPU pool need cores of
    their own next to it."""
    return max(1, min(8, len(os.sched_getaffinity(0)) // 2))


def _bit(b: int) -> int:
    return (1 << b) - (1 << 32) if b == 31 else 1 << b  # int32's sign bit


def new_tokens(r: Request, g: RequestGrammar,
               prev_token: Callable[[Request], int] | None) -> list[int]:
    """The output tokens r's grammar has not taken: token 0 and the prior outputs of a
    request resumed on this node, then one token per step. A placeholder (the previous
    step's unread sample) is read through prev_token."""
    todo = r.output_token_ids[g.num_accepted:]
    for k, t in enumerate(todo):
        if t == PLACEHOLDER:
            assert prev_token is not None, "a placeholder without a previous step"
            todo[k] = prev_token(r)
    return todo
