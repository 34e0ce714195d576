"""A launched engine step whose sampled ids the host has not read yet (deferred output)."""

from __future__ import annotations

from dataclasses import dataclass

from engine.request import Request
from engine.sampler import SamplerOutput


@dataclass
class InflightStep:
    """A launched step whose sampled ids the host has not read yet."""

    step_id: int
    requests: list[Request]  # row i of `out` belongs to requests[i]
    out_index: list[int]  # where in requests[i].output_token_ids row i's token goes
    out: SamplerOutput
    launched_ns: int = 0  # wall clock right after the launch (on CPU the forward has run)
