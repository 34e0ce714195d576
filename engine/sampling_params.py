"""Per-request sampling parameters, validated on construction with errors naming the field.

The fields' types, ranges and defaults are the table in ``engine.sampling_fields``; the
defaults below are checked against it by a unit test."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from engine import sampling_fields
from engine.grammar.spec import check_spec
from engine.sampling_fields import MAX_LOGPROBS

__all__ = ["MAX_LOGPROBS", "SamplingParams"]


@dataclass
class SamplingParams:
    max_tokens: int = 16  # output tokens at most, token 0 included
    min_tokens: int = 0  # EOS and stop token ids are masked until this many were produced
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0  # in (0, 1]
    top_k: int = 0  # 0 (or -1) means off
    min_p: float = 0.0  # in [0, 1]
    repetition_penalty: float = 1.0  # > 0; applies to prompt and output tokens
    frequency_penalty: float = 0.0  # in [-2, 2]; scaled by output-token counts
    presence_penalty: float = 0.0  # in [-2, 2]; once per distinct output token
    stop: list[str] = field(default_factory=list)  # stop strings (not in the output text)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    seed: int | None = None  # None: the engine draws one (still a pure function per position)
    logprobs: int | None = None  # None: none; N: sampled token's logprob plus top-N alternatives
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # Structured output (engine.grammar.spec): {"kind", "value"}; None: unconstrained. Not
    # in the sampling_fields table: it is a grammar, not a number with a range.
    structured: dict[str, str] | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.validate()

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5

    def validate(self) -> None:
        """ValueError naming the first bad field (the rules are engine.sampling_fields')."""
        sampling_fields.check(self.__dict__)
        if self.structured is not None:
            check_spec(self.structured)

    def to_dict(self) -> dict[str, Any]:
        """Plain fields, for handing a request's sampling state to another node."""
        return dict(self.__dict__)

    @staticmethod
    def from_dict(d: dict[str, Any]) -> SamplingParams:
        unknown = set(d) - set(SamplingParams.__dataclass_fields__)
        if unknown:
            raise ValueError(f"{sorted(unknown)[0]}: unknown sampling field")
        return SamplingParams(**d)
