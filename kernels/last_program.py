"""Per-token counters for the "last program done" pattern (CUDA's threadFenceReduction).

A kernel whose programs each make part of a token's row, and whose last program to finish
then works on the whole row (kernels/triton_router_route.py routes the token,
kernels/triton_moe_down_sum.py's NEXT_NORM runs the next RMSNorm), counts the programs
done per token in an int32 counter: each program increments it (acq_rel, gpu scope) after
its stores, and the one that reads programs - 1 is the last and resets it to 0.

Self-reset is what makes one buffer serve every layer, every step and every replay of a
captured graph with no memset launch: a launch leaves its counters as it found them (0),
and a later launch's programs start counting only after this one has completed (every
kernel in the chain waits for the one before to complete, kernels/pdl.py, or runs in
plain stream order), which it does only after each token's last program has reset its
counter. Two launches in flight at once on two streams of one device would break this:
the engine runs a device's forwards in one stream order.

Each kernel has its own pool (`CounterPool`), though the argument above would let them
share one: a buffer shared by two kernels would also need every kernel launched between
them to keep kernels/pdl.py's rules, and a pool costs 64 bytes a device.
"""

from __future__ import annotations

import torch

# Counters allocated on a device's first launch, whatever its token count: as many tokens
# as the engine sends through these kernels (engine.models.moe.ROUTER_LOGITS_MAX_TOKENS,
# kernels.triton_moe.DOWN_SUM_MAX_TOKENS), so that a graph captured later never needs a
# larger buffer.
MIN_COUNTERS = 16


class CounterPool:
    """One kernel's counters, a buffer per device: [>= T] int32, all zero between launches.
    `retired` keeps the buffers a larger one replaced: a graph captured with one keeps its
    address, so it is never freed (a few bytes each)."""

    def __init__(self, kernel: str) -> None:
        self.kernel = kernel  # named in the capture error
        self.buffers: dict[torch.device, torch.Tensor] = {}
        self.retired: list[torch.Tensor] = []

    def get(self, device: torch.device, tokens: int) -> torch.Tensor:
        """The device's counters, at least `tokens` of them. Allocated outside CUDA-graph
        capture only: during one, the buffer would come from the graph's private pool and
        its memset would become a node of the graph, the launch these kernels exist to
        save; so a capture that finds too few raises instead."""
        buf = self.buffers.get(device)
        if buf is not None and buf.numel() >= tokens:
            return buf
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            have = 0 if buf is None else buf.numel()
            raise RuntimeError(
                f"{self.kernel}: {tokens} tokens need {tokens} counters on {device}, {have} "
                "were allocated before this CUDA-graph capture; run the launch once "
                "uncaptured first (a warm-up) at the largest token count")
        if buf is not None:
            self.retired.append(buf)
        buf = torch.zeros(max(tokens, MIN_COUNTERS), dtype=torch.int32, device=device)
        self.buffers[device] = buf
        return buf
