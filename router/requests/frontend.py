"""The one request path behind both front doors (gRPC and HTTP): validate and tokenize,
check the cluster can serve, wait for an admission slot, dispatch, observe metrics.

Both doors build a ``GenerateRequest`` and iterate ``Frontend.generate``; a refusal is a
``RequestError`` raised before the first response, so each door can map it to its own
status (gRPC code, HTTP status) before anything was sent.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import AsyncGenerator

import grpc
from pdserve.v1 import router_pb2

from engine.tokenizer import Tokenizer
from router.control.registry import Registry
from router.requests.admission import Admission
from router.requests.direct_write import DirectWrite
from router.requests.dispatcher import Dispatcher, no_workers_message
from router.requests.errors import RequestError, invalid
from router.requests.health import wait_until_serving
from router.requests.metrics import RouterMetrics
from router.requests.tokenize_pool import TokenizePool
from router.requests.validation import (
    PreparedRequest,
    check_length,
    check_min_tokens,
    engine_params,
    input_size,
    prepare,
    prepare_in_pool,
)

# Inputs larger than this are tokenized on a thread of a bounded pool: a long prompt's chat
# template and BPE would otherwise hold the event loop, delaying other requests' token 0.
OFFLOOP_TOKENIZE_CHARS = 8192
# A request with structured output is prepared in the pool too (its grammar is compiled
# there to check it) and refused when that takes longer than this.
GRAMMAR_CHECK_S = 10.0


class Frontend:
    def __init__(self, dispatcher: Dispatcher, registry: Registry, tokenizer: Tokenizer,
                 model_id: str, model_names: set[str], max_tokens_limit: int,
                 admission: Admission, metrics: RouterMetrics,
                 *, tokenizer_source: str, tokenize_pool: TokenizePool | None = None
                 ) -> None:
        """tokenizer_source: the model whose tokenizer the tokenize pool's processes load."""
        self.dispatcher = dispatcher
        self.registry = registry
        self.tokenizer = tokenizer
        self.model_id = model_id  # the name ListModels and /v1/models report
        self.model_names = model_names  # every name a request's model may use
        self.max_tokens_limit = max_tokens_limit
        self.admission = admission
        self.metrics = metrics
        self.tokenize_pool = tokenize_pool or TokenizePool(
            retry_after_s=admission.retry_after_s, source=tokenizer_source)

    async def generate(self, request: router_pb2.GenerateRequest, received_ns: int, api: str,
                       *, fill_max_tokens: bool = False, direct: DirectWrite | None = None
                       ) -> AsyncGenerator[router_pb2.GenerateResponse, None]:
        """Streams the request's responses; refusals raise RequestError before the first.

        fill_max_tokens: an unset max_tokens means "up to the context length" (OpenAI chat)
        instead of the engine's default. direct: the client's stream (gRPC, or an HTTP SSE
        stream: router/http/sse_direct.py); a decoding
        request's plain tokens may be written to it straight from the worker's batch, and
        then never come out of this generator (they are observed all the same).
        """
        try:
            prep = await self._prepare(request, fill_max_tokens)
            obs = self.metrics.observe(api)
            if direct is not None:
                direct.observe = obs.on_tokens
            try:
                async for resp in self.dispatcher.generate(prep, received_ns, self.admission,
                                                           direct):
                    obs.on_response(resp)
                    yield resp
            except RequestError:
                obs.done = True  # counted as a refusal below, not as a cancellation
                raise
            finally:
                obs.cancelled()  # no-op once the last message went out
        except RequestError as e:
            self.metrics.refused(api, e.code.name)
            raise

    async def _prepare(self, request: router_pb2.GenerateRequest,
                       fill_max_tokens: bool) -> PreparedRequest:
        size = input_size(request)
        structured = request.sampling.HasField("structured")
        if structured:
            size += len(request.sampling.structured.value)
        if size > OFFLOOP_TOKENIZE_CHARS or structured:
            if not self.registry.serving():  # refuse before the expensive part
                raise RequestError(grpc.StatusCode.UNAVAILABLE,
                                   no_workers_message(self.registry))
            check_min_tokens(request, self.tokenizer, self.registry.max_model_len())
            work = self.tokenize_pool.run(size, functools.partial(
                prepare_in_pool, request, self.model_names, self.max_tokens_limit))
            if not structured:
                prep = await work
            else:
                # Compiling a grammar is bounded by llguidance's fuel (about 20 ms); the
                # wall-clock bound covers a busy pool process too.
                try:
                    prep = await asyncio.wait_for(work, GRAMMAR_CHECK_S)
                except TimeoutError as e:
                    raise RequestError(grpc.StatusCode.INVALID_ARGUMENT,
                                       f"sampling.structured: not compiled within "
                                       f"{GRAMMAR_CHECK_S:g} s") from e
        else:
            prep = prepare(request, self.tokenizer, self.model_names,
                           max_tokens_limit=self.max_tokens_limit)
        if not await wait_until_serving(self.registry):  # waits only during a role change
            raise RequestError(grpc.StatusCode.UNAVAILABLE, no_workers_message(self.registry))
        max_len = self.registry.max_model_len()
        room = max_len - len(prep.prompt_token_ids)
        if fill_max_tokens and not prep.sampling.HasField("max_tokens") and room >= 1:
            prep.sampling.max_tokens = min(room, self.max_tokens_limit)
            try:
                prep.params = engine_params(prep.sampling)
            except ValueError as e:  # e.g. min_tokens above the room left
                raise invalid(str(e)) from e
        check_length(prep, max_len)
        return prep
