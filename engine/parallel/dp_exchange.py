"""Moving tokens to the experts and back under data-parallel attention.

Each rank brings its own attention group's tokens to a MoE layer. ``dispatch`` pads them
to the step's largest per-rank count and all-gathers them over every rank, so each rank
routes every token of the step and runs the (token, expert) pairs of its own experts;
``combine`` reduce-scatters the partial sums, so each rank gets back the sum over all
experts for its own rows. A rank with no tokens (an idle group) still joins both with
zero rows: the padding makes every rank's part the same size, and the collectives pair.

All-gather + reduce-scatter, not all-to-all: it needs no routing-dependent sizes (the same
shapes every step, what CUDA graphs and gloo want) and moves T * m rows each way, where an
all-to-all moves each routed (token, expert) pair once; at decode batch sizes the
exchange is latency-bound, which favours the fixed shapes. Ranks of one attention group
(A > 1) bring the same tokens, so their rows are computed A times: the layout is meant for
A = 1 (D = T), where nothing is duplicated.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.parallel.group import TPGroup


@dataclass
class DPForward:
    """What every MoE layer of a rank needs about the step in flight; set before each
    forward (engine/parallel/dp_plan.py), read by ``ExpertExchange``."""

    max_tokens: int = 0  # the most tokens any rank runs this step (every part is padded)


class ExpertExchange:
    def __init__(self, ep: TPGroup, step: DPForward) -> None:
        self.ep = ep
        self.step = step

    def dispatch(self, x: torch.Tensor) -> torch.Tensor:
        """x [n, H], this rank's tokens -> [size * m, H], every rank's, rank-major."""
        m = self.step.max_tokens
        n = x.shape[0]
        assert n <= m, f"{n} tokens on a rank, the step's most is {m}"
        part = x if n == m else torch.cat([x, x.new_zeros(m - n, x.shape[1])])
        return self.ep.all_gather_rows(part)

    def combine(self, y: torch.Tensor, n: int) -> torch.Tensor:
        """y [size * m, H], this rank's partial sums for every rank's rows -> [n, H], the
        full sums for this rank's own n rows."""
        return self.ep.reduce_scatter_rows(y)[:n]
