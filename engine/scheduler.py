"""Continuous batching with chunked prefill under a per-step token budget.

A step's batch mixes decodes and prefill chunks. Running requests go first, in arrival
order; when blocks run out the newest running request is preempted (its blocks freed and
its KV recomputed later). Waiting requests are admitted while budget, seats and blocks last.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from engine.block_manager import BlockManager
from engine.request import Request
from engine.request_state import RequestState


class QueueFull(RuntimeError):
    """The waiting queue is at max_waiting; the caller should retry later."""


@dataclass
class ScheduledChunk:
    request: Request
    start: int  # first position computed this step (== num_computed_tokens when scheduled)
    num_tokens: int  # positions [start, start + num_tokens) are computed this step
    samples: bool  # the chunk reaches the request's last known token, so it samples one


@dataclass
class SchedulerOutput:
    chunks: list[ScheduledChunk] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)


class Scheduler:
    def __init__(self, blocks: BlockManager, max_num_seqs: int, max_num_batched_tokens: int,
                 max_waiting: int, max_model_len: int) -> None:
        self.max_model_len = max_model_len
        self.blocks = blocks
        self.max_num_seqs = max_num_seqs
        self.budget = max_num_batched_tokens
        self.max_waiting = max_waiting
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []

    def add(self, req: Request) -> None:
        if len(self.waiting) >= self.max_waiting:
            raise QueueFull(f"waiting queue is full ({self.max_waiting} requests)")
        self.waiting.append(req)

    def add_running(self, req: Request) -> None:
        """Admits a request whose KV is already in its blocks (a consumer's handed-off one)."""
        self.running.append(req)

    def remove(self, req: Request) -> None:
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def _preempt(self, req: Request, out: SchedulerOutput) -> None:
        self.blocks.free(req.block_ids)
        req.block_ids = []
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        req.state = RequestState.QUEUED
        self.waiting.appendleft(req)
        out.preempted.append(req)

    def _chunk(self, req: Request, n: int) -> ScheduledChunk:
        start = req.num_computed_tokens
        return ScheduledChunk(req, start, n, samples=start + n == req.num_tokens)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.budget
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            if req.needs_no_more_tokens(self.max_model_len):  # finishes when its step is read
                i += 1
                continue
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            assert n > 0, f"{req.request_id} is running with nothing to compute"
            while not self.blocks.grow(req.block_ids, req.num_computed_tokens + n):
                victim = self.running.pop()
                self._preempt(victim, out)
                if victim is req:
                    break
            else:
                out.chunks.append(self._chunk(req, n))
                budget -= n
                i += 1
        # A request preempted this step is not re-admitted in the same step: its blocks
        # just went to someone who needed them.
        while (self.waiting and budget > 0 and not out.preempted
               and len(self.running) < self.max_num_seqs):
            req = self.waiting[0]
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            if not self.blocks.grow(req.block_ids, req.num_computed_tokens + n):
                break
            self.waiting.popleft()
            req.state = RequestState.PREFILLING
            self.running.append(req)
            out.chunks.append(self._chunk(req, n))
            budget -= n
        return out

    def commit(self, out: SchedulerOutput) -> None:
        """Marks the scheduled positions computed (the forward for them has been launched)."""
        for c in out.chunks:
            c.request.num_computed_tokens = c.start + c.num_tokens
            if c.samples and c.request.state == RequestState.PREFILLING:
                c.request.state = RequestState.DECODING
