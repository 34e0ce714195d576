"""Rank 0's side of a data-parallel attention step (engine/parallel/dp_plan.py): one plan per
attention group from that group's chunks, every follower sent its group's, rank 0 runs its
own, samples every group's rows at once and broadcasts the ids to every rank.

The chunks of a step come slot by slot (engine/dp_scheduler.py); rows of the sampled-id
tensor are in that order, so a group's plan names its placeholder inputs by their row in
the whole step's tensor, which every rank holds after the broadcast.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch

from engine.inflight_step import InflightStep
from engine.parallel.dp_groups import DPLayout
from engine.parallel.dp_plan import DPPlan, run_dp_plan
from engine.parallel.step_plan import StepPlan
from engine.request import Request
from engine.sampler import SamplerOutput, SamplingBatch
from engine.scheduler import ScheduledChunk


class DPHost(Protocol):
    """What a data-parallel step needs of the engine's ``ModelRunner``."""

    followers: Any
    model: Any
    kv_cache: torch.Tensor
    device: torch.device

    def _plan(self, chunks: list[ScheduledChunk],
              prev_rows: dict[int, int]) -> tuple[StepPlan, list[Request]]: ...

    def _sample(self, logits: torch.Tensor, batch: SamplingBatch) -> SamplerOutput: ...

    def _sampling_batch(self, reqs: list[Request], prev: InflightStep | None,
                        prev_rows: dict[int, int]) -> SamplingBatch: ...


def execute_dp(runner: DPHost, layout: DPLayout, chunks: list[ScheduledChunk],
               prev: InflightStep | None) -> tuple[list[Request], SamplerOutput]:
    followers = runner.followers
    assert followers is not None and runner.model.ep_group is not None
    prev_rows = {id(r): i for i, r in enumerate(prev.requests)} if prev else {}
    plans: list[StepPlan | None] = []
    samplers: list[Request] = []
    counts: list[int] = []
    for g in range(layout.dp_size):
        mine = [c for c in chunks if c.request.dp_rank == g]
        if not mine:
            plans.append(None)
            counts.append(0)
            continue
        plan, reqs = runner._plan(mine, prev_rows)
        plans.append(plan)
        samplers += reqs
        counts.append(len(reqs))
    most = max(len(p.input_ids) for p in plans if p is not None)
    step = [DPPlan(plans[layout.dp_rank(r)], most, counts, layout.attn_size)
            for r in range(layout.tp_size)]
    followers.send_each(step[1:])
    logits = run_dp_plan(runner.model, runner.kv_cache, step[0],
                         prev.out.device_token_ids if prev else None,
                         runner.model.ep_group, runner.device)
    if logits is None:
        return samplers, SamplerOutput(token_ids=torch.empty(0, dtype=torch.int64))
    out = runner._sample(logits, runner._sampling_batch(samplers, prev, prev_rows))
    # every rank's next step may read these as inputs
    runner.model.ep_group.broadcast(out.device_token_ids, 0)
    return samplers, out
