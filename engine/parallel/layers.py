"""Vocabulary-parallel embedding and LM head: each rank holds `vocab_shard` rows."""

from __future__ import annotations

import torch
from torch import nn

from engine.parallel.group import TPGroup
from engine.parallel.shards import TPShard


class VocabParallelEmbedding(nn.Module):
    def __init__(self, shard: TPShard, vocab: int, hidden: int, group: TPGroup | None) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(shard.vocab_shard, hidden))  # [Vs, H]; pad rows 0
        self.start, self.rows = shard.vocab_start, shard.vocab_rows
        self.group = group

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [T] -> [T, H]: each rank embeds the ids it owns, zeros elsewhere, summed."""
        if self.group is None:
            return nn.functional.embedding(ids, self.weight)
        local = ids - self.start
        mine = (local >= 0) & (local < self.rows)
        x = nn.functional.embedding(local.clamp(0, max(self.rows - 1, 0)), self.weight)
        x = x * mine.unsqueeze(-1).to(x.dtype)
        return self.group.all_reduce(x)


class ParallelLMHead(nn.Module):
    def __init__(self, shard: TPShard, vocab: int, hidden: int, group: TPGroup | None) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(shard.vocab_shard, hidden))  # [Vs, H]; pad rows 0
        self.vocab = vocab
        self.group = group

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """[S, H] -> [S, vocab] float32 on every rank (rank 0 samples from it)."""
        logits = nn.functional.linear(hidden, self.weight)  # [S, Vs], the model's dtype
        if self.group is None:
            return logits.float()
        # gathered before the cast: the same values, half the bytes of float32 (bf16/fp16)
        return self.group.all_gather_cat(logits)[:, :self.vocab].float()
