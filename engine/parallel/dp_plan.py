"""One step under data-parallel attention: each attention group runs its own plan, and
every rank joins the same collectives in the same order whatever its group holds.

Order of a step on every rank: the model's forward (its attention-group collectives, if
A > 1, and one dispatch + combine per MoE layer over all ranks), then the gather of the
sampled rows' logits to rank 0 (when any group samples), then rank 0's broadcast of the
sampled ids (the next step's inputs, rows in group order). A rank whose group has no
tokens runs a zero-token step: no attention, but every MoE layer's exchange with no rows
of its own, the gather with no rows, and the broadcast, so no collective waits on it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from engine.models.llama import LlamaForCausalLM
from engine.models.moe import SparseMoeBlock
from engine.parallel.group import TPGroup
from engine.parallel.step_plan import StepPlan, run_plan


@dataclass
class DPPlan:
    """What one rank runs for a step; rank 0 builds one per attention group."""

    KIND: ClassVar[str] = "dp-plan"  # on the rank channel (engine.parallel.messages)
    plan: StepPlan | None  # its group's forward; None: the group has no tokens this step
    max_tokens: int  # the most tokens any group runs (each MoE exchange pads to it)
    sample_counts: list[int]  # rows each group samples, in group order
    attn_size: int  # ranks per attention group (the gather takes each group's first rank)

    @property
    def num_sampled(self) -> int:
        return sum(self.sample_counts)


def idle_forward(model: LlamaForCausalLM, device: torch.device) -> None:
    """The zero-token forward of a rank whose group has nothing to run: each MoE layer's
    exchange with no rows, in layer order (the only collectives it shares with the other
    groups)."""
    dtype = model.embed_tokens.weight.dtype
    empty = torch.empty(0, model.cfg.hidden_size, dtype=dtype, device=device)
    for layer in model.layers:
        mlp = layer.mlp
        if isinstance(mlp, SparseMoeBlock) and mlp.exchange is not None:
            mlp(empty)


def run_dp_plan(model: LlamaForCausalLM, kv_cache: torch.Tensor, dp: DPPlan,
                prev_ids: torch.Tensor | None, ep: TPGroup,
                device: torch.device) -> torch.Tensor | None:
    """Runs this rank's part of the step; on rank 0 returns the sampled rows' logits of
    every group, [sum(sample_counts), vocab] float32 in group order (None elsewhere, or
    when nothing samples). prev_ids: the previous step's sampled ids of every group."""
    model.dp_step.max_tokens = dp.max_tokens
    logits = None
    if dp.plan is not None:
        logits = run_plan(model, kv_cache, dp.plan, prev_ids, device)
    else:
        idle_forward(model, device)
    if not dp.num_sampled:
        return None
    return _gather_logits(logits, dp, ep, model.cfg.vocab_size, device)


def _gather_logits(logits: torch.Tensor | None, dp: DPPlan, ep: TPGroup, vocab: int,
                   device: torch.device) -> torch.Tensor | None:
    """Each rank's sampled rows, padded to the largest group's count, gathered at rank 0."""
    most = max(dp.sample_counts)
    part = torch.zeros(most, vocab, dtype=torch.float32, device=device)
    if logits is not None:
        part[:logits.shape[0]] = logits
    outs = ep.gather_to_0(part)
    if outs is None:
        return None
    rows = [outs[g * dp.attn_size][:n] for g, n in enumerate(dp.sample_counts)]
    return torch.cat(rows)
