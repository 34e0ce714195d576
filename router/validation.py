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

import grpc
from pdserve.v1 import common_pb2, router_pb2

from engine.sampling_params import SamplingParams
from engine.tokenizer import Tokenizer

CHAT_ROLES = ("system", "user", "assistant")
MAX_REQUEST_ID_LEN = 256
# Proto fields whose presence is tracked (optional): unset means "engine default".
_OPTIONAL = ("max_tokens", "temperature", "top_p", "repetition_penalty", "seed", "logprobs",
             "skip_special_tokens")
_PLAIN = ("min_tokens", "top_k", "min_p", "frequency_penalty", "presence_penalty",
          "ignore_eos", "include_stop_str_in_output")


class RequestError(Exception):
    """A request the router refuses, with the gRPC status to refuse it with."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


def invalid(message: str) -> RequestError:
    return RequestError(grpc.StatusCode.INVALID_ARGUMENT, message)


@dataclass
class PreparedRequest:
    request_id: str
    prompt_token_ids: list[int]
    sampling: common_pb2.SamplingParams  # forwarded to workers as the client sent it
    params: SamplingParams  # the validated engine view (defaults filled in)
    seed: int  # the request's seed, or one drawn here so both legs share it


def engine_params(s: common_pb2.SamplingParams) -> SamplingParams:
    """The engine's SamplingParams for a proto one; ValueError("sampling.<field>: ...")."""
    kw: dict[str, object] = {n: getattr(s, n) for n in _OPTIONAL if s.HasField(n)}
    kw.update({n: getattr(s, n) for n in _PLAIN})
    kw["stop"] = list(s.stop)
    kw["stop_token_ids"] = list(s.stop_token_ids)
    try:
        return SamplingParams(**kw)  # type: ignore[arg-type]
    except ValueError as e:
        raise ValueError(f"sampling.{e}") from e


def prepare(req: router_pb2.GenerateRequest, tokenizer: Tokenizer, model_names: set[str],
            *, max_tokens_limit: int, draw_seed: Callable[[], int] | None = None
            ) -> PreparedRequest:
    """Everything that needs no worker: id, model, sampling, tokenization."""
    if len(req.request_id) > MAX_REQUEST_ID_LEN:
        raise invalid(f"request_id: at most {MAX_REQUEST_ID_LEN} characters")
    if req.model and req.model not in model_names:
        raise invalid(f"model: {req.model!r} is not served here (served: "
                      f"{', '.join(sorted(model_names))})")
    try:
        params = engine_params(req.sampling)
    except ValueError as e:
        raise invalid(str(e)) from e
    if params.max_tokens > max_tokens_limit:
        raise invalid(f"sampling.max_tokens: must be <= {max_tokens_limit}, "
                      f"got {params.max_tokens}")
    vocab = tokenizer.vocab_size
    for i, t in enumerate(params.stop_token_ids):
        if t >= vocab:
            raise invalid(f"sampling.stop_token_ids[{i}]: token id {t} is outside the "
                          f"vocabulary (size {vocab})")
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
    n = len(prep.prompt_token_ids)
    if n >= max_model_len:
        raise invalid(f"prompt: {n} tokens, max_model_len is {max_model_len} (room for one "
                      f"output token needed)")
    if n + prep.params.max_tokens > max_model_len:
        raise invalid(f"sampling.max_tokens: prompt ({n} tokens) + max_tokens "
                      f"({prep.params.max_tokens}) exceeds max_model_len ({max_model_len})")


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
        vocab = tokenizer.vocab_size
        for i, t in enumerate(ids):
            if t >= vocab:
                raise invalid(f"prompt_token_ids[{i}]: token id {t} is outside the "
                              f"vocabulary (size {vocab})")
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
