"""What a simulated engine pretends to be: its step time and its end-of-sequence rate.

A simulated engine (``--simulate-step-ms``) runs the real scheduler, block manager, KV
transfer and output path, but no model: each step "runs" for a configured time and samples
token ids from a cheap pure function of (seed, position) (engine/sim_runner.py). It exists
to measure the serving plane (router, worker services, streams) at GPU token rates on any
machine, as llm-d's inference-sim does for llm-d. Torch-free: the worker's gRPC process and
the CLI build it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class SimConfig:
    """How long a simulated step takes, and whether it ever samples EOS."""

    step_ms: float  # every step's forward, whatever its batch (the decode step at load)
    # added per prompt token a step computes (prefill chunks), on top of step_ms
    prefill_us_per_token: float = 0.0
    # chance that a token past min_tokens is EOS (0: never, so outputs run to max_tokens)
    eos_prob: float = 0.0
    # host time of launching a step that computes prompt tokens: on a GPU host an eager
    # prefill launch is thousands of small torch calls, ~18-24 ms for an 8B model, during
    # which the engine thread holds the GIL but for microsecond gaps (sim_runner.py)
    prefill_launch_ms: float = 0.0

    def __post_init__(self) -> None:
        checks = [
            ("simulate_step_ms", self.step_ms, 0 <= self.step_ms < math.inf, ">= 0"),
            ("simulate_prefill_us_per_token", self.prefill_us_per_token,
             0 <= self.prefill_us_per_token < math.inf, ">= 0"),
            ("simulate_eos_prob", self.eos_prob, 0 <= self.eos_prob <= 1, "in [0, 1]"),
            ("simulate_prefill_launch_ms", self.prefill_launch_ms,
             0 <= self.prefill_launch_ms < math.inf, ">= 0"),
        ]
        for flag, value, ok, why in checks:
            if not ok:  # a NaN fails too
                raise ValueError(f"{flag}: must be {why}, got {value!r}")

    def step_s(self, prefill_tokens: int) -> float:
        """Seconds a step computing ``prefill_tokens`` prompt tokens takes."""
        return (self.step_ms * 1e3 + self.prefill_us_per_token * prefill_tokens) * 1e-6
