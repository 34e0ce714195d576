"""A large HTTP body, read into a request in a tokenize pool process, not on the loop.

Every step of a large body holds the GIL, and so the router's loop: json.loads and building
the request's protobuf (it copies and checks the text) cost ~1 ms per MB each on an idle
core here, and many times that on a busy one (`python bench/router_stall_probe.py --mb 12`);
any client may send many such bodies. In the pool process the body is parsed, checked
field by field (the same 400s), and a prompt that cannot fit ``max_model_len`` is refused
there by the cheap bound (validation.check_min_tokens), so the refusal of a huge body never
crosses back as text; only a request that may fit comes back, to be tokenized the usual way.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from router.http.http_errors import HttpError
from router.http.openai_request import OpenAIRequest
from router.requests.tokenize_pool import child_tokenizer
from router.requests.validation import check_min_tokens


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
