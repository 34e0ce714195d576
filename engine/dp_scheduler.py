"""One scheduling slot per attention data-parallel group, behind the Scheduler's interface.

Under data-parallel attention (engine/parallel/dp_groups.py) each of the D groups holds its
own requests' KV, so each is its own slot: a Scheduler with its own waiting, running and
reservation queues over its own BlockManager (block ids index that group's pool, which
lives on that group's ranks). A request stays on the slot it was placed on
(``Request.dp_rank``) for its whole life, preemption included. A step schedules every slot
under its own token budget and seats; the chunks come out slot by slot, in slot order,
which is the order the runner builds the groups' plans and samples their rows.

Placement: the caller names a slot, or the least loaded one is taken (running plus
queued requests, then free blocks).
"""

from __future__ import annotations

from collections.abc import Sequence

from engine.block_manager import BlockAccounting, BlockManager
from engine.config import EngineConfig
from engine.prefix_cache import PrefixCache
from engine.request import Request
from engine.scheduler import Scheduler, SchedulerOutput

FLAG = "dp_rank"


def make_scheduler(config: EngineConfig, blocks: BlockManager,
                   max_model_len: int) -> Scheduler | DPScheduler:
    """The engine's scheduler over ``blocks``; with data-parallel attention, slot 0 over
    ``blocks`` and one more slot per other group, each over its own pool of the same size
    (it lives on that group's ranks)."""

    def slot(pool: BlockManager) -> Scheduler:
        return Scheduler(pool, config.max_num_seqs, config.max_num_batched_tokens,
                         config.max_waiting, max_model_len)

    if config.data_parallel_size == 1:
        return slot(blocks)
    return DPScheduler([slot(blocks)] + [
        slot(BlockManager(blocks.num_blocks, blocks.block_size,
                          PrefixCache() if config.enable_prefix_caching else None))
        for _ in range(1, config.data_parallel_size)])


class DPScheduler:
    def __init__(self, slots: Sequence[Scheduler]) -> None:
        self.slots = list(slots)

    # ---- placement ---------------------------------------------------------------------

    def place(self, req: Request, dp_rank: int | None) -> None:
        """Sets req.dp_rank: the one asked for (ValueError naming the field when there is
        no such slot), else the least loaded slot."""
        if dp_rank is None:
            dp_rank = min(range(len(self.slots)), key=self._load_key)
        elif not isinstance(dp_rank, int) or not 0 <= dp_rank < len(self.slots):
            raise ValueError(f"{FLAG}: must be in [0, {len(self.slots)}), got {dp_rank!r}")
        req.dp_rank = dp_rank

    def _load_key(self, i: int) -> tuple[int, int]:
        s = self.slots[i]
        queued = len(s.running) + len(s.waiting) + len(s.reserving) + len(s.awaiting_kv)
        return queued, -s.blocks.accounting().free

    def slot_of(self, req: Request) -> Scheduler:
        return self.slots[req.dp_rank]

    def pool(self, req: Request) -> BlockManager:
        return self.slots[req.dp_rank].blocks

    def loads(self) -> list[dict[str, int]]:
        """Per slot: what a worker's load report says of the whole engine."""
        out = []
        for s in self.slots:
            acc = s.blocks.accounting()
            out.append({"waiting": len(s.waiting), "running": len(s.running),
                        "kv_blocks_free": acc.free, "kv_blocks_total": acc.total})
        return out

    def accounting(self) -> BlockAccounting:
        accs = [s.blocks.accounting() for s in self.slots]
        return BlockAccounting(total=sum(a.total for a in accs), free=sum(a.free for a in accs),
                               used=sum(a.used for a in accs),
                               cached=sum(a.cached for a in accs))

    # ---- the Scheduler's interface -----------------------------------------------------

    @property
    def waiting(self) -> list[Request]:
        return [r for s in self.slots for r in s.waiting]

    @property
    def running(self) -> list[Request]:
        return [r for s in self.slots for r in s.running]

    @property
    def tokens_computed(self) -> int:
        return sum(s.tokens_computed for s in self.slots)

    def add(self, req: Request) -> None:
        self.slot_of(req).add(req)

    def add_remote(self, req: Request) -> None:
        self.slot_of(req).add_remote(req)

    def add_running(self, req: Request) -> None:
        self.slot_of(req).add_running(req)

    def kv_landed(self, req: Request) -> None:
        self.slot_of(req).kv_landed(req)

    def remove(self, req: Request) -> None:
        self.slot_of(req).remove(req)

    def cache_written(self, req: Request, written: int) -> None:
        self.slot_of(req).cache_written(req, written)

    def has_work(self) -> bool:
        return any(s.has_work() for s in self.slots)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        for s in self.slots:
            part = s.schedule()
            out.chunks += part.chunks
            out.preempted += part.preempted
            out.reserved += part.reserved
        return out

    def commit(self, out: SchedulerOutput) -> None:
        for i, s in enumerate(self.slots):
            s.commit(SchedulerOutput([c for c in out.chunks if c.request.dp_rank == i]))
