"""GenerateRequest -> a checked, tokenized request; every refusal names the field at fault.

The router tokenizes once (chat template included) so workers only ever see token ids,
and it rejects what a worker would reject (same SamplingParams validation, same length
rule as the engine) before any worker is involved.
"""

from __future__ import annotations

import secrets
import uuid
from collections.abc import Callable
from dataclasses import dataclass

from pdserve.v1 import common_pb2, router_pb2

from engine.request_limits import check_ids, check_lengths, check_request_id
from engine.sampling_fields import wire_values
from engine.sampling_params import SamplingParams
from engine.tokenizer import Tokenizer
from router.requests.errors import invalid

# OpenAI's roles ("developer" is renamed "system" by the HTTP door); a "tool" message is
# a tool's result, rendered by the chat template like any other turn.
CHAT_ROLES = ("system", "user", "assistant", "tool")


@dataclass
class PreparedRequest:
    request_id: str
    prompt_token_ids: list[int]
    sampling: common_pb2.SamplingParams  # forwarded to workers as the client sent it
    params: SamplingParams  # the validated engine view (defaults filled in)
    seed: int  # the request's seed, or one drawn here so both legs share it


def engine_params(s: common_pb2.SamplingParams) -> SamplingParams:
    """The engine's SamplingParams for a proto one, read through the same table (float32
    rounding included) as the worker's conversion; ValueError("sampling.<field>: ...")."""
    try:
        return SamplingParams(**wire_values(s))
    except ValueError as e:
        raise ValueError(f"sampling.{e}") from e


def prepare(req: router_pb2.GenerateRequest, tokenizer: Tokenizer, model_names: set[str],
            *, max_tokens_limit: int, draw_seed: Callable[[], int] | None = None
            ) -> PreparedRequest:
    """Everything that needs no worker: id, model, sampling, tokenization."""
    try:
        check_request_id(req.request_id)
    except ValueError as e:
        raise invalid(str(e)) from e
    if req.model and req.model not in model_names:
        raise invalid(f"model: {req.model!r} is not served here (served: "
                      f"{', '.join(sorted(model_names))})")
    # One limit, one message, checked before the engine's own ">= 1" rule: the HTTP door
    # says the same (router/http/openai_request.py).
    if req.sampling.HasField("max_tokens") and not 1 <= req.sampling.max_tokens \
            <= max_tokens_limit:
        raise invalid(f"sampling.max_tokens: must be in [1, {max_tokens_limit}], "
                      f"got {req.sampling.max_tokens}")
    try:
        params = engine_params(req.sampling)
    except ValueError as e:
        raise invalid(str(e)) from e
    try:
        check_ids(params.stop_token_ids, tokenizer.vocab_size, "sampling.stop_token_ids")
    except ValueError as e:
        raise invalid(str(e)) from e
    ids = _tokenize(req, tokenizer)
    if params.seed is not None:
        seed = params.seed
    else:
        seed = draw_seed() if draw_seed is not None else secrets.randbits(63)
    return PreparedRequest(request_id=req.request_id or uuid.uuid4().hex,
                           prompt_token_ids=ids, sampling=req.sampling, params=params,
                           seed=seed)


def check_length(prep: PreparedRequest, max_model_len: int) -> None:
    """The engine's own admission rule, applied before any worker sees the request."""
    try:
        check_lengths(len(prep.prompt_token_ids), prep.params.max_tokens, max_model_len,
                      max_tokens_field="sampling.max_tokens")
    except ValueError as e:
        raise invalid(str(e)) from e


def prepare_in_pool(req: router_pb2.GenerateRequest, model_names: set[str],
                    max_tokens_limit: int) -> PreparedRequest:
    """``prepare`` in a tokenize pool process, with that process's tokenizer."""
    from router.requests.tokenize_pool import child_tokenizer

    return prepare(req, child_tokenizer(), model_names, max_tokens_limit=max_tokens_limit)


def check_min_tokens(req: router_pb2.GenerateRequest, tokenizer: Tokenizer,
                     max_model_len: int) -> None:
    """Refuses, before tokenizing it, a prompt that cannot fit: its least possible token
    count already reaches ``max_model_len`` (what a client could otherwise make the router
    tokenize, over and over, for free)."""
    least = min_prompt_tokens(req, tokenizer)
    if least >= max_model_len:
        raise invalid(f"prompt: at least {least} tokens ({input_size(req)} characters), "
                      f"max_model_len is {max_model_len} (room for one output token needed)")


def min_prompt_tokens(req: router_pb2.GenerateRequest, tokenizer: Tokenizer) -> int:
    """A lower bound on the prompt's token count, without tokenizing it: no token covers
    more than ``tokenizer.max_token_chars`` characters (the chat template only adds)."""
    if req.WhichOneof("input") == "prompt_token_ids":
        return len(req.prompt_token_ids.ids)
    return -(-input_size(req) // tokenizer.max_token_chars)


def input_size(req: router_pb2.GenerateRequest) -> int:
    """Rough size of the input in characters/ids, to decide whether to tokenize off-loop."""
    kind = req.WhichOneof("input")
    if kind == "prompt":
        return len(req.prompt)
    if kind == "chat":
        return sum(len(m.content) for m in req.chat.messages)
    if kind == "prompt_token_ids":
        return len(req.prompt_token_ids.ids)
    return 0


def _tokenize(req: router_pb2.GenerateRequest, tokenizer: Tokenizer) -> list[int]:
    kind = req.WhichOneof("input")
    if kind is None:
        raise invalid("input: one of prompt, chat or prompt_token_ids is required")
    if kind == "prompt":
        if not req.prompt:
            raise invalid("prompt: must not be empty")
        ids = tokenizer.encode(req.prompt)
    elif kind == "chat":
        ids = _encode_chat(req.chat, tokenizer)
    else:
        ids = list(req.prompt_token_ids.ids)
        if not ids:
            raise invalid("prompt_token_ids: must not be empty")
        try:
            check_ids(ids, tokenizer.vocab_size, "prompt_token_ids")
        except ValueError as e:
            raise invalid(str(e)) from e
        return ids
    if not ids:
        raise invalid(f"{kind}: encodes to no tokens")
    return ids


def _encode_chat(chat: router_pb2.ChatMessages, tokenizer: Tokenizer) -> list[int]:
    if not chat.messages:
        raise invalid("chat.messages: must not be empty")
    for i, m in enumerate(chat.messages):
        if m.role not in CHAT_ROLES:
            raise invalid(f"chat.messages[{i}].role: must be one of {', '.join(CHAT_ROLES)}, "
                          f"got {m.role!r}")
    messages = [{"role": m.role, "content": m.content} for m in chat.messages]
    try:
        return tokenizer.encode_chat(messages)
    except ValueError as e:
        # The tokenizer names "messages[...]" / "chat_template"; say where it sits here.
        raise invalid(f"chat.{e}") from e
