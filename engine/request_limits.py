"""What a request must satisfy against one model: token ids inside the vocabulary, prompt
plus output inside the context. The router checks these before any worker is involved and
every worker checks them again at its own gRPC door (anyone on the cluster network may call
it), with these same functions, so both refuse the same requests in the same words.

Errors are ValueError("<field>: <why>") with the field named as the caller's wire names it.
"""

from __future__ import annotations

from collections.abc import Iterable

MAX_REQUEST_ID_LEN = 256


def check_request_id(rid: str, field: str = "request_id") -> None:
    if len(rid) > MAX_REQUEST_ID_LEN:
        raise ValueError(f"{field}: at most {MAX_REQUEST_ID_LEN} characters")


def check_ids(ids: Iterable[int], vocab_size: int, field: str) -> None:
    """Every id in [0, vocab_size): an id past the vocabulary indexes past the logits."""
    for i, t in enumerate(ids):
        if not 0 <= t < vocab_size:
            raise ValueError(f"{field}[{i}]: token id {t} is outside the vocabulary (size "
                             f"{vocab_size})")


def check_lengths(prompt_len: int, max_tokens: int, max_model_len: int,
                  prompt_field: str = "prompt", max_tokens_field: str = "max_tokens") -> None:
    """The engine's admission rule: room for the prompt and every output token."""
    if prompt_len >= max_model_len:
        raise ValueError(f"{prompt_field}: {prompt_len} tokens, max_model_len is "
                         f"{max_model_len} (room for one output token needed)")
    if prompt_len + max_tokens > max_model_len:
        raise ValueError(f"{max_tokens_field}: prompt ({prompt_len} tokens) + max_tokens "
                         f"({max_tokens}) exceeds max_model_len ({max_model_len})")
