"""One simulated worker: the engine's scheduling rules on counters instead of tensors.

``schedule`` follows ``engine/scheduler.py`` step for step: running requests first in
arrival order under the token budget, the newest running request preempted (blocks freed,
KV recomputed later) when blocks run out, then waiting requests admitted while budget,
seats (``max_num_seqs``) and blocks last, none in a step that preempted. Blocks are counted,
not named: which block a request holds never changes a step's cost.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from deploy.plan.profile import Profile

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
    token_times: list[float] = field(default_factory=list)
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
        self.total_blocks = profile.kv_capacity_blocks
        self.free = self.total_blocks
        self.max_seqs = limits.max_num_seqs
        self.budget = limits.max_num_batched_tokens
        self.waiting: deque[SimRequest] = deque()
        self.running: list[SimRequest] = []
        self.reservations: deque[SimRequest] = deque()  # consumer: waiting for blocks
        self.busy = False
        self.inflight = 0  # requests given to this worker and not done with it (router count)
        self.dispatched = 0
        self.link_free_at = 0.0  # producer: when its outbound transfers are done
        self.preemptions = 0
        self.pending: list[Chunk] = []  # the chunks of the step in flight

    def load_score(self, kv_weight: float) -> float:
        return self.inflight + kv_weight * (1.0 - self.free / self.total_blocks)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def _need(self, req: SimRequest, upto: int) -> int:
        return max(0, -(-upto // self.bs) - req.blocks)

    def _preempt(self, victim: SimRequest) -> None:
        self.free += victim.blocks
        victim.blocks = 0
        victim.computed = 0
        self.waiting.appendleft(victim)
        self.preemptions += 1

    def schedule(self) -> list[Chunk]:
        chunks: list[Chunk] = []
        budget = self.budget
        preempted = False
        running = self.running
        i = 0
        while i < len(running) and budget > 0:
            req = running[i]
            n = min(req.num_tokens - req.computed, budget)
            need = self._need(req, req.computed + n)
            if need > self.free:
                while need > self.free:
                    victim = running.pop()
                    self._preempt(victim)
                    preempted = True
                    if victim is req:
                        break
                    need = self._need(req, req.computed + n)
                if victim is req:
                    continue
            self.free -= need
            req.blocks += need
            chunks.append(Chunk(req, req.computed, n))
            budget -= n
            i += 1
        while self.waiting and budget > 0 and not preempted and len(running) < self.max_seqs:
            req = self.waiting[0]
            n = min(req.num_tokens - req.computed, budget)
            need = self._need(req, req.computed + n)
            if need > self.free:
                break
            self.waiting.popleft()
            self.free -= need
            req.blocks += need
            running.append(req)
            chunks.append(Chunk(req, req.computed, n))
            budget -= n
        return chunks

    def step_ms(self, chunks: list[Chunk]) -> float:
        """A step's cost: the prefill curve over all its tokens, plus the decode grid's extra
        for attending over long contexts (which the prefill curve, measured on fresh
        prompts, does not see)."""
        p = self.profile
        decodes = 0
        prefill_tokens = 0
        ctx_sum = 0
        for c in chunks:
            if c.n == 1 and c.start >= c.req.prompt_len:
                decodes += 1
                ctx_sum += c.start + 1
            else:
                prefill_tokens += c.n
        if decodes == 0:
            return p.prefill_ms(prefill_tokens)
        ctx = ctx_sum / decodes
        dec = p.decode_ms(decodes, ctx)
        if prefill_tokens == 0:
            return dec
        extra = max(0.0, dec - p.decode_ms(decodes, p.decode.context[0]))
        return p.prefill_ms(prefill_tokens + decodes) + extra

    def release(self, req: SimRequest) -> None:
        self.free += req.blocks
        req.blocks = 0
