"""One forward, described on the host: what rank 0's runner builds from the scheduled
chunks and what every tensor-parallel rank turns into the same tensors and runs."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from engine.attention import AttentionMetadata
from engine.models.llama import LlamaForCausalLM


@dataclass
class StepPlan:
    KIND: ClassVar[str] = "plan"  # on the rank channel (engine.parallel.messages)
    input_ids: list[int]  # [T]; 0 where the input is the previous step's sample
    positions: list[int]  # [T]
    slots: list[int]  # [T] cache slot of each token
    cu_seqlens_q: list[int]  # [B + 1]
    seq_lens: list[int]  # [B] context length after this step
    block_tables: list[list[int]]  # [B, W], zero-padded
    sample_at: list[int]  # flat token indices whose logits are sampled
    fix_at: list[int]  # flat token indices whose input is the previous step's sample ...
    fix_from: list[int]  # ... taken from this row of that step's sampled ids

    @property
    def decode_only(self) -> bool:
        return len(self.input_ids) == len(self.seq_lens)


def _tensor(data: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return torch.tensor(data, dtype=dtype).to(device, non_blocking=True)


def run_plan(model: LlamaForCausalLM, kv_cache: torch.Tensor, plan: StepPlan,
             prev_ids: torch.Tensor | None, device: torch.device) -> torch.Tensor | None:
    """Runs the forward; returns logits [S, vocab] float32 of the sampled rows (None when
    none are sampled). prev_ids [S'] int64: the previous step's sampled ids, on the device."""
    input_ids = _tensor(plan.input_ids, torch.int64, device)
    if plan.fix_at:
        assert prev_ids is not None
        input_ids[_tensor(plan.fix_at, torch.int64, device)] = \
            prev_ids[_tensor(plan.fix_from, torch.int64, device)]
    meta = AttentionMetadata(
        slot_mapping=_tensor(plan.slots, torch.int64, device),
        block_tables=_tensor(plan.block_tables, torch.int32, device),
        cu_seqlens_q=_tensor(plan.cu_seqlens_q, torch.int32, device),
        seq_lens=_tensor(plan.seq_lens, torch.int32, device),
        decode_only=plan.decode_only,
        max_seq_len=max(plan.seq_lens),
        cu_seqlens_q_host=plan.cu_seqlens_q,
        seq_lens_host=plan.seq_lens,
    )
    hidden = model(input_ids, _tensor(plan.positions, torch.int64, device), kv_cache, meta)
    if not plan.sample_at:
        return None
    return model.compute_logits(hidden[_tensor(plan.sample_at, torch.int64, device)])
