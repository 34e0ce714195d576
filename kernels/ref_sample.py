"""Torch reference of the simple sampler: greedy or temperature-only seeded draws.

Row s is greedy (argmax of the logits) when temperature[s] <= 0; otherwise it draws from
softmax(logits / T) by the exponential race argmax(p / E), E = -log(u), with u the
counter-based noise of (seeds[s], positions[s]) (kernels.random_draw). Top-k/p, min-p,
penalties and logprobs are the full sampler's (engine.sampler); this is the common case
that a CUDA graph can hold.
"""

from __future__ import annotations

import torch

from kernels.random_draw import uniform_noise


def sample_simple_ref(
    logits: torch.Tensor,  # [S, V] float
    temperature: torch.Tensor,  # [S] float32; <= 0: greedy
    seeds: torch.Tensor,  # [S] int64
    positions: torch.Tensor,  # [S] int64: position of the token being sampled
    out: torch.Tensor | None = None,  # [S] int64
) -> torch.Tensor:
    logits = logits.float()
    greedy = logits.argmax(dim=-1)
    hot = temperature > 0
    if bool(hot.any()):
        temp = torch.where(hot, temperature, 1.0)
        probs = torch.softmax(logits / temp[:, None], dim=-1)
        expo = -torch.log(uniform_noise(seeds.long(), positions.long(), logits.shape[-1]))
        greedy = torch.where(hot, (probs / expo).argmax(dim=-1), greedy)
    if out is None:
        return greedy
    out.copy_(greedy)
    return out
