"""What an engine step reports for each request that made progress."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from engine.request import LogprobRow
from engine.request_state import RequestState

if TYPE_CHECKING:  # light module (the gRPC process imports it): no torch at run time
    from engine.sampler import SamplerOutput


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
    seed: int = 0  # the request's sampling seed (a producer hands it to the consumer)
    # prompt tokens whose KV a prefix-cache hit supplied at the request's first admission
    # (OpenAI usage.prompt_tokens_details.cached_tokens); a consumer's: reused at reservation
    num_cached_tokens: int = 0

    @property
    def finished(self) -> bool:
        return self.state.finished


@dataclass
class StepResult:
    """One step's outputs, plus what the roles need from it, so producer/ and consumer/
    never read engine internals."""

    outputs: list[RequestOutput] = field(default_factory=list)
    # consumer: remote requests the scheduler gave blocks this step (id -> block ids)
    reserved: dict[str, list[int]] = field(default_factory=dict)
    # ... of which the leading N already hold the prompt's KV (add_remote with
    # reuse_cached): the sender must skip them. Absent: 0
    reserved_cached: dict[str, int] = field(default_factory=dict)
    # producer: leading prompt blocks whose KV is final after this step (0 after a
    # preemption); all of them once token 0 is out
    final_blocks: dict[str, int] = field(default_factory=dict)
    finished: list[str] = field(default_factory=list)  # requests whose last output was here
    # A CUDA event recorded right after this step's kernels (None on CPU, or without a
    # step): the KV the step wrote, final_blocks' included, is complete once it has. A
    # producer's pushes wait for it rather than for the stream's work so far, which, for a
    # push made while the next step runs (LLMEngine.device_wait), is that step too.
    kv_written: object | None = None


@dataclass(frozen=True)
class HeldRequest:
    """One request a worker holds, for GET /debug/requests and orphan accounting."""

    request_id: str
    state: RequestState
    age_s: float  # since the engine got it
    state_age_s: float  # since its last state change
    blocks: int  # KV blocks it holds (its own plus those pinned for a transfer)


def logprob_rows(out: SamplerOutput) -> list[LogprobRow] | None:
    """A step's sampled rows as LogprobRows (None: no request asked for logprobs)."""
    if out.logprobs is None:
        return None
    lp = out.logprobs.tolist()
    ids = out.token_ids.tolist()
    if out.top_ids is None or out.top_logprobs is None:
        return [LogprobRow(t, v) for t, v in zip(ids, lp, strict=True)]
    tops = [tuple(zip(a, b, strict=True)) for a, b in zip(out.top_ids.tolist(),
                                                         out.top_logprobs.tolist(), strict=True)]
    return [LogprobRow(t, v, top) for t, v, top in zip(ids, lp, tops, strict=True)]
