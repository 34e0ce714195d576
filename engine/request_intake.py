"""What the engine checks before it takes a request, and how a migrated one resumes.

Kept apart from the engine loop: these are pure functions of the request and the model's
limits, shared by every way in (add_request, add_remote, add_prefilled). Errors are
ValueError("<field>: <why>"), the field named as the engine's API names it.
"""

from __future__ import annotations

from engine.block_manager import BlockManager
from engine.request import LogprobRow, Request
from engine.request_limits import check_ids
from engine.sampling_params import SamplingParams
from engine.stop_check import streamable_len


def check_new(prompt_token_ids: list[int], params: SamplingParams, vocab_size: int,
              max_model_len: int, blocks: BlockManager) -> None:
    if not prompt_token_ids:
        raise ValueError("prompt: must not be empty")
    if any(not 0 <= t < vocab_size for t in prompt_token_ids):
        raise ValueError(f"prompt: token ids must be in [0, {vocab_size})")
    if len(prompt_token_ids) >= max_model_len:
        raise ValueError(f"prompt: {len(prompt_token_ids)} tokens, max_model_len is "
                         f"{max_model_len} (room for one output token needed)")
    params.validate()
    # a stop id past the vocabulary would index past the logits (min_tokens' ban)
    check_ids(params.stop_token_ids, vocab_size, "stop_token_ids")
    if len(prompt_token_ids) + params.max_tokens > max_model_len:
        raise ValueError(
            f"max_tokens: prompt ({len(prompt_token_ids)}) + max_tokens "
            f"({params.max_tokens}) exceeds max_model_len ({max_model_len})")
    need = blocks.blocks_for(len(prompt_token_ids) + params.max_tokens)
    if need > blocks.num_blocks:
        raise ValueError(
            f"max_tokens: prompt + max_tokens needs {need} KV blocks, the pool has "
            f"{blocks.num_blocks}")


def check_prior(prompt_token_ids: list[int], params: SamplingParams,
                prior_output_ids: list[int], vocab_size: int, max_model_len: int) -> None:
    """The output tokens a migrated request resumes after."""
    if any(not 0 <= t < vocab_size for t in prior_output_ids):
        raise ValueError(f"prior_output_ids: token ids must be in [0, {vocab_size})")
    if len(prior_output_ids) >= params.max_tokens:
        raise ValueError(f"prior_output_ids: {len(prior_output_ids)} tokens, max_tokens "
                         f"is {params.max_tokens} (nothing left to generate)")
    if len(prompt_token_ids) + len(prior_output_ids) >= max_model_len:
        raise ValueError(f"prior_output_ids: prompt + {len(prior_output_ids)} prior "
                         f"tokens reach max_model_len ({max_model_len})")


def resume_after(req: Request, prior: list[int]) -> None:
    """Makes req look as it did after emitting ``prior``: their text was already sent (as
    much as was streamable), their logprob rows too (kept by position, so stand-ins)."""
    req.output_token_ids.extend(prior)
    req.num_prior_outputs = req.num_emitted = len(prior)
    if req.params.logprobs is not None:
        req.logprobs.extend(LogprobRow(t, 0.0) for t in prior)
    if req.detok is not None:
        req.full_text = "".join(req.detok.add(t) for t in prior)
    req.text_checked = len(req.full_text)
    req.num_text_sent = streamable_len(req)
