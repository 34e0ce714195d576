"""One request's state inside an engine."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from engine.request_state import RequestState, check_transition
from engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from engine.detokenizer import IncrementalDetokenizer
    from engine.grammar.matcher import RequestGrammar

# Stands in an output slot whose token was sampled but not yet read back to the host
# (deferred output); the runner feeds the device-side value instead.
PLACEHOLDER = -1


@dataclass(frozen=True)
class LogprobRow:
    """One sampled token's logprob row: the one shape in engine output and worker messages."""

    token_id: int
    logprob: float
    # the top-N alternatives (token id, logprob), best first
    top: tuple[tuple[int, float], ...] = ()


TokenLogprob = LogprobRow  # the older name, kept for callers outside the lifecycle code


@dataclass
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    seed: int  # params.seed, or one the engine drew; random draws are f(seed, position)
    arrival_time: float = field(default_factory=time.monotonic)
    state: RequestState = RequestState.QUEUED
    output_token_ids: list[int] = field(default_factory=list)  # may end in PLACEHOLDERs
    num_computed_tokens: int = 0  # tokens whose KV is in this engine's cache
    block_ids: list[int] = field(default_factory=list)
    # extra references to blocks a transfer may still read (producer pushes): they outlive
    # a preemption or an abort and return to the pool only in release()
    pinned: list[int] = field(default_factory=list)
    state_since: float = field(default_factory=time.monotonic)  # when state last changed
    logprobs: list[LogprobRow] = field(default_factory=list)
    num_emitted: int = 0  # output tokens already reported to the caller
    num_preemptions: int = 0
    prefill_only: bool = False  # producer: stop after token 0 and hold blocks for transfer
    # Output tokens it was admitted with: a request migrated off a failed worker resumes
    # after the tokens its client already has (they count as outputs, not prompt).
    num_prior_outputs: int = 0
    detok: IncrementalDetokenizer | None = None
    # structured output: the matcher that masks its next token (None: unconstrained)
    grammar: RequestGrammar | None = None
    full_text: str = ""  # detokenized output so far (cut at a stop string when one hits)
    text_checked: int = 0  # full_text[:text_checked] has been searched for stop strings
    num_text_sent: int = 0  # full_text[:num_text_sent] has been reported
    # Prefix caching (engine/prefix_cache.py). The root of this request's block hash chain
    # (model, adapter, cache salt); None: its blocks are never looked up or cached (caching
    # off, or KV this engine cannot vouch for, e.g. add_prefilled's).
    cache_root: bytes | None = None
    block_hashes: list[bytes] = field(default_factory=list)  # its leading full blocks', lazily
    num_registered_blocks: int = 0  # block_ids[:n] were hits or offered to the cache
    num_cached_tokens: int | None = None  # prompt tokens found cached when first admitted
    reuse_cached: bool = False  # consumer: its reservation may take cached leading blocks
    dp_rank: int = 0  # attention data-parallel group whose queues and KV pool hold it

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def finished(self) -> bool:
        return self.state.finished

    def move(self, new: RequestState) -> None:
        """Changes state along an edge of the lifecycle; BadTransition on any other."""
        check_transition(self.state, new)
        self.state = new
        self.state_since = time.monotonic()

    def needs_no_more_tokens(self, max_model_len: int) -> bool:
        """True once the sampled (maybe unread) tokens reach a limit known in advance, so a
        deferred engine does not launch a step whose token would be dropped anyway."""
        n = len(self.output_token_ids)
        return (n >= self.params.max_tokens or self.num_tokens >= max_model_len
                or (self.prefill_only and n > self.num_prior_outputs))

    def token_at(self, pos: int) -> int:
        n = len(self.prompt_token_ids)
        return self.prompt_token_ids[pos] if pos < n else self.output_token_ids[pos - n]
