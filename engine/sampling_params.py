"""Per-request sampling parameters, validated on construction with errors naming the field."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

MAX_LOGPROBS = 20


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

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.validate()

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5

    def validate(self) -> None:
        def bad(name: str, why: str) -> ValueError:
            return ValueError(f"{name}: {why}, got {getattr(self, name)!r}")

        for name in ("max_tokens", "min_tokens", "top_k"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool):
                raise bad(name, "must be an integer")
        for name in ("temperature", "top_p", "min_p", "repetition_penalty",
                     "frequency_penalty", "presence_penalty"):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or isinstance(v, bool) or v != v:
                raise bad(name, "must be a number")
        if self.max_tokens < 1:
            raise bad("max_tokens", "must be >= 1")
        if self.min_tokens < 0 or self.min_tokens > self.max_tokens:
            raise bad("min_tokens", "must be in [0, max_tokens]")
        if self.temperature < 0:
            raise bad("temperature", "must be >= 0")
        if not 0 < self.top_p <= 1:
            raise bad("top_p", "must be in (0, 1]")
        if self.top_k < -1:
            raise bad("top_k", "must be -1, 0 (off) or positive")
        if not 0 <= self.min_p <= 1:
            raise bad("min_p", "must be in [0, 1]")
        if self.repetition_penalty <= 0:
            raise bad("repetition_penalty", "must be > 0")
        for name in ("frequency_penalty", "presence_penalty"):
            if not -2 <= getattr(self, name) <= 2:
                raise bad(name, "must be in [-2, 2]")
        if not isinstance(self.stop, list) or not all(isinstance(s, str) for s in self.stop):
            raise bad("stop", "must be a string or a list of strings")
        if any(s == "" for s in self.stop):
            raise bad("stop", "stop strings must not be empty")
        if not isinstance(self.stop_token_ids, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) and t >= 0
            for t in self.stop_token_ids
        ):
            raise bad("stop_token_ids", "must be a list of non-negative integers")
        if self.seed is not None and (not isinstance(self.seed, int) or isinstance(self.seed, bool)
                                      or not 0 <= self.seed < 2**63):
            raise bad("seed", "must be an integer in [0, 2**63)")
        if self.logprobs is not None and (
            not isinstance(self.logprobs, int) or not 0 <= self.logprobs <= MAX_LOGPROBS
        ):
            raise bad("logprobs", f"must be an integer in [0, {MAX_LOGPROBS}]")

    def to_dict(self) -> dict[str, Any]:
        """Plain fields, for handing a request's sampling state to another node."""
        return dict(self.__dict__)

    @staticmethod
    def from_dict(d: dict[str, Any]) -> SamplingParams:
        unknown = set(d) - set(SamplingParams.__dataclass_fields__)
        if unknown:
            raise ValueError(f"{sorted(unknown)[0]}: unknown sampling field")
        return SamplingParams(**d)
