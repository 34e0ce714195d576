"""A large HTTP body, read into a request in a tokenize pool process, not on the loop.

Every step of a 12 MB body holds the GIL, and so the router's loop: json.loads (~25 ms per
MB here), building the request's protobuf (it copies and checks the text: ~15 ms per MB),
even len() of the text read back from it. In the pool process the body is parsed, checked
field by field (the same 400s), and a prompt that cannot fit ``max_model_len`` is refused
there by the cheap bound (validation.check_min_tokens), so the refusal of a huge body never
crosses back as text; only a request that may fit comes back, to be tokenized the usual way.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from multiprocessing import resource_tracker, shared_memory
from typing import Any

from router.http_errors import HttpError
from router.openai_request import OpenAIRequest
from router.tokenize_pool import child_tokenizer
from router.validation import check_min_tokens


def parse_shared_body(shm_name: str, size: int, parse: Callable[[Any], OpenAIRequest],
                      max_model_len: int) -> OpenAIRequest:
    """``parse_large_body`` of a body the router left in shared memory: handing 12 MB to a
    process through the executor's pipe pickles it with the GIL held (~8 ms per MB here),
    a copy into shared memory costs a memcpy."""
    shm = shared_memory.SharedMemory(name=shm_name)
    try:
        # the router owns (and unlinks) it: this process must not, at its exit
        resource_tracker.unregister(shm._name, "shared_memory")  # type: ignore[attr-defined]
        buf = shm.buf
        assert buf is not None  # None only once closed
        raw = bytes(buf[:size])
    finally:
        shm.close()
    return parse_large_body(raw, parse, max_model_len)


def parse_large_body(raw: bytes, parse: Callable[[Any], OpenAIRequest], max_model_len: int
                     ) -> OpenAIRequest:
    """In a pool process: ``parse(json.loads(raw))``, then the length bound (skipped when
    ``max_model_len`` is 0: no worker yet; the frontend refuses that itself)."""
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise HttpError(400, f"body: not valid JSON ({e})", param="body") from None
    req = parse(body)
    if max_model_len > 0:
        check_min_tokens(req.generate, child_tokenizer(), max_model_len)
    return req
