"""One simulated worker: the engine's scheduling policy on counters instead of tensors.

``schedule`` runs the engine's own batch-forming policy (``engine/batch_policy.py``, which
the engine's ``Scheduler`` runs too): running requests first in arrival order under the
token budget, the newest running request preempted (blocks freed, KV recomputed later) when
blocks run out, then waiting requests admitted while budget, seats (``max_num_seqs``) and
blocks last, none in a step that preempted. Blocks are counted, not named: which block a
request holds never changes a step's cost; the simulator has no prefix cache. A consumer's
reservations are granted outside the step (``Simulator._grant``).

A worker of D attention data-parallel groups (``Profile.dp_size``) is D slots stepping
together, each with the profile's pool, seats and budget; the worker places each request
on its least loaded group, modelled here as perfectly balanced groups: one pool, seats and
budget D times a group's, and a step of B decodes (P prompt tokens) costs a group's part,
ceil(B / D) (ceil(P / D), or its longest chunk, which one group runs whole), in the
profile.
"""

from __future__ import annotations

import bisect
from array import array
from collections import deque
from dataclasses import dataclass, field

from deploy.plan.profile import Profile
from engine.batch_policy import form_batch

COLOCATED, PRODUCER, CONSUMER = "colocated", "producer", "consumer"


@dataclass(eq=False)
class SimRequest:
    index: int
    prompt_len: int
    output_len: int
    arrival: float  # seconds
    num_tokens: int = 0  # positions known: prompt plus tokens generated so far
    computed: int = 0  # positions whose KV is computed on the worker running it now
    blocks: int = 0  # blocks held on the worker running it now
    # when each output token reached the client (seconds); an array, for 10^7-token runs
    token_times: array[float] = field(default_factory=lambda: array("d"))
    producer: SimWorker | None = None
    consumer: SimWorker | None = None
    reserved: bool = False  # the consumer holds blocks for its prompt
    pushed: int = 0  # prompt tokens whose KV the producer has pushed
    prefilled_at: float | None = None  # the producer sampled token 0
    landed_at: float | None = None  # the last block reached the consumer
    error: str = ""

    def __post_init__(self) -> None:
        self.num_tokens = self.prompt_len


@dataclass(eq=False)
class Chunk:
    req: SimRequest
    start: int
    n: int


@dataclass(frozen=True)
class EngineLimits:
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512


class SimWorker:
    def __init__(self, wid: int, role: str, profile: Profile, limits: EngineLimits) -> None:
        self.wid = wid
        self.role = role
        self.profile = profile
        self.bs = profile.block_size
        self.dp = profile.dp_size
        self.total_blocks = profile.kv_capacity_blocks * self.dp
        self.free = self.total_blocks
        self.max_seqs = limits.max_num_seqs * self.dp
        self.budget = limits.max_num_batched_tokens * self.dp
        self.waiting: deque[SimRequest] = deque()
        self.running: list[SimRequest] = []
        self.reservations: deque[SimRequest] = deque()  # consumer: waiting for blocks
        self.busy = False
        self.inflight = 0  # requests given to this worker and not done with it (router count)
        self.dispatched = 0
        self.link_free_at = 0.0  # producer: when its outbound transfers are done
        self.preemptions = 0
        self.pending: list[Chunk] = []  # the chunks of the step in flight
        self.ends: list[float] = []  # end times of the steps in flight (a bundle, see below)
        self.gen = 0  # bumps when the bundle in flight is cut short (older events are stale)
        # Overlap scheduling on a synchronous device (Profile.sync_steps): the tokens of a
        # step read only after the next step, when one follows at once; (request, index of
        # the token time to move to that step's end).
        self.defers = role != PRODUCER and profile.sync_steps
        self.deferred: list[tuple[SimRequest, int]] = []
        self._pool = _Pool(self)

    def load_score(self, kv_weight: float) -> float:
        return self.inflight + kv_weight * (1.0 - self.free / self.total_blocks)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def _need(self, req: SimRequest, upto: int) -> int:
        return max(0, -(-upto // self.bs) - req.blocks)

    def schedule(self) -> list[Chunk]:
        batch = form_batch(self.running, self.waiting, self.budget, self._pool)
        return [Chunk(req, start, n) for req, start, n in batch.chunks]

    def step_ms(self, chunks: list[Chunk]) -> float:
        """A step's cost: the prefill curve over all its tokens, plus the decode grid's extra
        for attending over long contexts (which the prefill curve, measured on fresh
        prompts, does not see)."""
        p = self.profile
        decodes = 0
        prefill_tokens = 0
        longest = 0  # a chunk runs on one group whole
        ctx_sum = 0
        for c in chunks:
            if c.n == 1 and c.start >= c.req.prompt_len:
                decodes += 1
                ctx_sum += c.start + 1
            else:
                prefill_tokens += c.n
                longest = max(longest, c.n)
        ctx = ctx_sum / max(decodes, 1)
        decodes = self._per_group(decodes)
        prefill_tokens = max(self._per_group(prefill_tokens), longest)
        if decodes == 0:
            return p.prefill_ms(prefill_tokens)
        dec = p.decode_ms(decodes, ctx)
        if prefill_tokens == 0:
            return dec
        extra = max(0.0, dec - p.decode_ms(decodes, p.decode.context[0]))
        return p.prefill_ms(prefill_tokens + decodes) + extra

    def _per_group(self, n: int) -> int:
        """One attention group's share of n balanced rows."""
        return -(-n // self.dp)

    MAX_BUNDLE = 256

    def bundle(self, chunks: list[Chunk], now: float) -> list[float]:
        """End times of the next steps: one step, or, when the batch is all decodes of every
        running request and nothing waits, the steps until the first of them finishes, run
        as one event. Those steps would schedule exactly the same batch (no request joins
        or leaves, and their blocks are taken now, so none can run out); an arrival or a
        landing cuts the bundle short after the step in progress (``cut``), so it joins
        at the same step boundary it would have."""
        first = self.step_ms(chunks) / 1e3
        if (self.role == PRODUCER or self.waiting or len(chunks) != len(self.running)
                or any(c.n != 1 or c.start < c.req.prompt_len for c in chunks)):
            return [now + first]
        k = min(self.MAX_BUNDLE, min(c.req.output_len - len(c.req.token_times) for c in chunks))
        if k > 1 and sum(self._need(c.req, c.start + k) for c in chunks) > self.free:
            k = 1
        if k > 1:
            for c in chunks:
                need = self._need(c.req, c.start + k)
                c.req.blocks += need
                self.free -= need
        ends = [now + first]
        if k > 1:
            # within one context segment of the profile's grid a step's cost is linear in
            # the context, so the bundle's steps cost an arithmetic series
            d = len(chunks)
            ctx = sum(c.start + 1 for c in chunks) / d
            grid = self.profile.decode.context
            i = bisect.bisect_right(grid, ctx)
            if i < len(grid):
                k = min(k, int(grid[i] - ctx) + 1)
            if k > 1:
                slope = (self.profile.decode_ms(self._per_group(d), ctx + k - 1)
                         - first * 1e3) / (k - 1) / 1e3
                t, step = ends[0], first
                for _ in range(1, k):
                    step += slope
                    t += step
                    ends.append(t)
            self.untake(chunks, k)
        return ends

    def untake(self, chunks: list[Chunk], k: int) -> None:
        """Gives back blocks taken for more steps than the bundle kept."""
        for c in chunks:
            keep = -(-(c.start + k) // self.bs)
            if c.req.blocks > keep:
                self.free += c.req.blocks - keep
                c.req.blocks = keep

    def cut(self, now: float) -> float | None:
        """Ends the bundle in flight after the step in progress at ``now``; the new end time,
        or None when there was nothing to cut."""
        if not self.busy or len(self.ends) < 2:
            return None
        j = bisect.bisect_left(self.ends, now)
        if j >= len(self.ends) - 1:
            return None
        self.ends = self.ends[:j + 1]
        self.gen += 1
        return self.ends[-1]

    def trim(self, req: SimRequest) -> None:
        """Gives back blocks taken for bundle steps that a cut left unrun."""
        keep = -(-req.computed // self.bs)
        if req.blocks > keep:
            self.free += req.blocks - keep
            req.blocks = keep

    def release(self, req: SimRequest) -> None:
        self.free += req.blocks
        req.blocks = 0


class _Pool:
    """The batch policy's view of a simulated worker (engine.batch_policy.BatchPool):
    positions and blocks as counters."""

    def __init__(self, w: SimWorker) -> None:
        self.w = w

    def finished(self, req: SimRequest) -> bool:
        return False  # a simulated request leaves ``running`` when its last token is read

    def computed(self, req: SimRequest) -> int:
        return req.computed

    def remaining(self, req: SimRequest) -> int:
        return req.num_tokens - req.computed

    def grow(self, req: SimRequest, upto: int) -> bool:
        need = self.w._need(req, upto)
        if need > self.w.free:
            return False
        self.w.free -= need
        req.blocks += need
        return True

    def preempt(self, req: SimRequest) -> None:
        self.w.free += req.blocks
        req.blocks = 0
        req.computed = 0
        self.w.preemptions += 1

    def seats(self) -> int:
        return self.w.max_seqs - len(self.w.running)

    def admission(self, req: SimRequest, budget: int) -> tuple[int, int] | None:
        n = min(req.num_tokens - req.computed, budget)
        return None if self.w._need(req, req.computed + n) > self.w.free else (req.computed, n)

    def admit(self, req: SimRequest, start: int, n: int) -> None:
        taken = self.grow(req, start + n)
        assert taken, "admission() said the blocks were there"
