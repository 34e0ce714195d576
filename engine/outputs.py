"""What an engine step reports for each request that made progress."""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.request import LogprobRow
from engine.request_state import RequestState


@dataclass
class RequestOutput:
    request_id: str
    new_token_ids: list[int]  # tokens produced since the last report for this request
    new_text: str  # their text (stop strings cut off); "" when the engine has no tokenizer
    state: RequestState
    finish_reason: str | None  # "stop" | "length" | "abort" | "error" | None while running
    num_prompt_tokens: int
    num_output_tokens: int
    sampled_step: int  # id of the engine step whose forward sampled the newest token
    emitted_step: int  # id of the engine step that reported it (== sampled_step if direct)
    sampled_ns: int = 0  # wall clock (ns) when the forward that sampled it had run
    new_logprobs: list[LogprobRow] = field(default_factory=list)
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it

    @property
    def finished(self) -> bool:
        return self.state.finished
