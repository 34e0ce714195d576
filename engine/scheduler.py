"""Continuous batching with chunked prefill under a per-step token budget.

A step's batch mixes decodes and prefill chunks. Running requests go first, in arrival
order; when blocks run out the newest running request is preempted (its blocks freed and
its KV recomputed later). Waiting requests are admitted while budget, seats and blocks last.
That policy is ``engine/batch_policy.py`` (the planner's simulated worker runs it too);
this module keeps the requests, their blocks and states, and the remote reservations.

Remote requests (a consumer's: their KV is computed elsewhere) queue in ``reserving`` and
are admitted by the same policy, FIFO: a seat and the blocks for the prompt, no token
budget since nothing is computed here. Admitted, they wait for the KV (``awaiting_kv``)
holding both, and join ``running`` once it landed.

Prefix caching (engine/prefix_cache.py): a request admitted from ``waiting`` (new, or back
after a preemption) takes the longest run of cached blocks matching its token chain and
starts computing after them; the last known token is always computed, since its forward
samples the next. A consumer's reservation may take cached leading blocks too
(``reuse_cached``), so only the rest has to arrive. Blocks are offered to the cache once
their KV is fully written (the step that computed them has been read back, or the
transfer that carried them is done): a cached block may be read by anything, a transfer
included, which is not ordered after a step still running on the device.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from engine.batch_policy import form_batch
from engine.block_manager import BlockAccounting, BlockManager
from engine.prefix_hash import BlockHash, block_hash
from engine.request import PLACEHOLDER, Request
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
    reserved: list[Request] = field(default_factory=list)  # remote requests given blocks

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
        self.reserving: deque[Request] = deque()  # remote, waiting for blocks and a seat
        self.awaiting_kv: dict[str, Request] = {}  # remote, blocks held, KV not landed
        self.tokens_computed = 0  # positions whose forward was launched, ever (cache hits
        # are the positions a request did not need to compute)
        self._pool = _Pool(self)

    def pool(self, req: Request) -> BlockManager:
        """The KV pool holding req's blocks (one here; one per slot in DPScheduler)."""
        return self.blocks

    def place(self, req: Request, dp_rank: int | None) -> None:
        """One attention group: only group 0 (or none) may be asked for."""
        if dp_rank not in (None, 0):
            raise ValueError(f"dp_rank: this engine has one attention group, got {dp_rank!r}")

    def loads(self) -> list[dict[str, int]]:
        """The load of each attention group: this one's."""
        acc = self.blocks.accounting()
        return [{"waiting": len(self.waiting), "running": len(self.running),
                 "kv_blocks_free": acc.free, "kv_blocks_total": acc.total}]

    def accounting(self) -> BlockAccounting:
        return self.blocks.accounting()

    def add(self, req: Request) -> None:
        if len(self.waiting) >= self.max_waiting:
            raise QueueFull(f"waiting queue is full ({self.max_waiting} requests)")
        self.waiting.append(req)

    def add_remote(self, req: Request) -> None:
        if len(self.reserving) >= self.max_waiting:
            raise QueueFull(f"reservation queue is full ({self.max_waiting} requests)")
        self.reserving.append(req)

    def add_running(self, req: Request) -> None:
        """Admits a request whose KV is already in its blocks (a consumer's handed-off one)."""
        self.running.append(req)

    def kv_landed(self, req: Request) -> None:
        del self.awaiting_kv[req.request_id]
        self.running.append(req)

    def remove(self, req: Request) -> None:
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        elif req in self.reserving:
            self.reserving.remove(req)
        else:
            self.awaiting_kv.pop(req.request_id, None)

    def has_work(self) -> bool:
        """Work a step can do now: compute, or a reservation that fits the pool."""
        return bool(self.waiting or self.running) or self._remote_fits()

    def _seats(self) -> int:
        return self.max_num_seqs - len(self.running) - len(self.awaiting_kv)

    def _remote_fits(self) -> bool:
        return (bool(self.reserving) and self._seats() > 0
                and self._reservation(self.reserving[0]) is not None)

    def _reservation(self, req: Request) -> list[int] | None:
        """The cached blocks a remote request's reservation would take, or None while it
        does not fit. Never the block holding the last token: the sender always has that
        one to send, and its final notice (token 0) travels with a push."""
        hit = self._prefix_hit(req, req.num_tokens - 1) if req.reuse_cached else []
        fits = self.blocks.fits(hit, self.blocks.blocks_for(req.num_tokens) - len(hit))
        return hit if fits else None

    # ---- prefix caching -------------------------------------------------------------------

    def _hashes(self, req: Request, n_blocks: int) -> list[BlockHash]:
        """The chain hashes of req's first n_blocks full blocks, as far as its tokens are
        known (a deferred step's unread sample ends them); computed once per request."""
        assert req.cache_root is not None
        hs, bs = req.block_hashes, self.blocks.block_size
        while len(hs) < n_blocks:
            toks = _tokens(req, len(hs) * bs, (len(hs) + 1) * bs)
            if PLACEHOLDER in toks:
                break
            hs.append(block_hash(hs[-1] if hs else req.cache_root, toks))
        return hs[:n_blocks]

    def _prefix_hit(self, req: Request, max_tokens: int) -> list[int]:
        """Cached blocks holding req's leading full blocks within its first max_tokens."""
        if self.blocks.cache is None or req.cache_root is None:
            return []
        return self.blocks.match(self._hashes(req, max_tokens // self.blocks.block_size))

    def _take_prefix(self, req: Request, hit: list[int], looked_up: bool) -> None:
        """req becomes an owner of its prefix hit, its first blocks; looked_up: the cache
        was asked (counted in its stats)."""
        assert not req.block_ids, f"{req.request_id} already holds blocks"
        self.blocks.take(hit)
        req.block_ids = list(hit)
        req.num_registered_blocks = len(hit)
        cached = len(hit) * self.blocks.block_size
        if req.num_cached_tokens is None:  # reported once, for its first admission
            req.num_cached_tokens = min(cached, req.num_prompt_tokens)
            if self.blocks.cache is not None and req.cache_root is not None and looked_up:
                self.blocks.cache.record_query(req.num_tokens, cached)

    def cache_written(self, req: Request, written: int) -> None:
        """Offers req's leading full blocks whose KV is fully written (positions below
        ``written``: a read step's, or a landed transfer's) to the cache, each block once."""
        if self.blocks.cache is None or req.cache_root is None or not req.block_ids:
            return
        k = req.num_registered_blocks
        # num_computed_tokens: a preemption since the write dropped the KV
        upto = min(written, req.num_computed_tokens)
        full = min(upto // self.blocks.block_size, len(req.block_ids))
        if full <= k:
            return
        hs = self._hashes(req, full)
        if len(hs) <= k:
            return
        self.blocks.register(req.block_ids[k:len(hs)], hs[k:], hs[k - 1] if k else None)
        req.num_registered_blocks = len(hs)

    # ---- the step -------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        batch = form_batch(self.running, self.waiting, self.budget, self._pool)
        out = SchedulerOutput(
            [ScheduledChunk(r, start, n, samples=start + n == r.num_tokens)
             for r, start, n in batch.chunks], batch.preempted)
        # Not after a preemption either: the freed blocks may still be written by the step
        # in flight, and a transfer landing in them would not be ordered after it.
        while not out.preempted and self.reserving and self._seats() > 0:
            req = self.reserving[0]
            reuse = self._reservation(req)
            if reuse is None:
                break
            self.reserving.popleft()
            self._take_prefix(req, reuse, looked_up=req.reuse_cached)
            # prompt, plus the prior outputs a migrated request's KV also covers
            req.block_ids += self.blocks.allocate(
                self.blocks.blocks_for(req.num_tokens) - len(reuse))
            req.move(RequestState.WAITING_FOR_KV)
            self.awaiting_kv[req.request_id] = req
            out.reserved.append(req)
        return out

    def commit(self, out: SchedulerOutput) -> None:
        """Marks the scheduled positions computed (the forward for them has been launched)."""
        for c in out.chunks:
            c.request.num_computed_tokens = c.start + c.num_tokens
            self.tokens_computed += c.num_tokens
            r = c.request
            if c.samples and r.state == RequestState.PREFILLING and not r.prefill_only:
                r.move(RequestState.DECODING)  # a producer's waits for token 0's read


class _Pool:
    """The batch policy's view of this scheduler (engine.batch_policy.BatchPool)."""

    def __init__(self, s: Scheduler) -> None:
        self.s = s
        self.hits: dict[str, list[int]] = {}  # admission's prefix hit, taken by admit

    def finished(self, req: Request) -> bool:
        return req.needs_no_more_tokens(self.s.max_model_len)  # ends when its step is read

    def computed(self, req: Request) -> int:
        return req.num_computed_tokens

    def remaining(self, req: Request) -> int:
        n = req.num_tokens - req.num_computed_tokens
        assert n > 0, f"{req.request_id} is running with nothing to compute"
        return n

    def grow(self, req: Request, upto: int) -> bool:
        return self.s.blocks.grow(req.block_ids, upto)

    def preempt(self, req: Request) -> None:
        # Pinned blocks (a transfer may be reading them) keep their extra reference. Cached
        # ones stay cached: its recompute (or anyone) may find them again.
        self.s.blocks.free(req.block_ids)
        req.block_ids = []
        req.num_registered_blocks = 0
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        req.move(RequestState.QUEUED)

    def seats(self) -> int:
        return self.s._seats()

    def admission(self, req: Request, budget: int) -> tuple[int, int] | None:
        # Not the last token: its forward must run to sample the next one.
        s = self.s
        hit = s._prefix_hit(req, req.num_tokens - 1)
        start = len(hit) * s.blocks.block_size
        n = min(req.num_tokens - start, budget)
        if not s.blocks.fits(hit, s.blocks.blocks_for(start + n) - len(hit)):
            return None
        self.hits[req.request_id] = hit
        return start, n

    def admit(self, req: Request, start: int, n: int) -> None:
        self.s._take_prefix(req, self.hits.pop(req.request_id), looked_up=True)
        req.num_computed_tokens = start
        grown = self.s.blocks.grow(req.block_ids, start + n)
        assert grown, "fits() said the blocks were there"
        req.move(RequestState.PREFILLING)


def _tokens(req: Request, a: int, b: int) -> list[int]:
    """req's token ids at positions [a, b) (prompt, then outputs), without joining lists."""
    p = req.prompt_token_ids
    n = len(p)
    if b <= n:
        return p[a:b]
    if a >= n:
        return req.output_token_ids[a - n:b - n]
    return p[a:] + req.output_token_ids[:b - n]
