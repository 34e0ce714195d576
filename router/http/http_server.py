"""The router's OpenAI-compatible HTTP front door (aiohttp, on the router's event loop).

Routes: POST /v1/chat/completions and /v1/completions (JSON or SSE), GET /v1/models[/id],
/health, /metrics, /openapi.json, and GET /debug/requests (every request the router holds
and its state; behind the API key like /v1/*). Requests go through the same ``Frontend`` as gRPC, so
validation, admission and dispatch are one code path; this file only translates.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from typing import Any

from aiohttp import web
from pdserve.v1 import router_pb2

from router.auth import UNAUTHENTICATED_MESSAGE, bearer_ok, http_ssl_context
from router.config import RouterConfig
from router.http.http_errors import HttpError, from_request_error
from router.http.large_body import parse_large_body
from router.http.openai_request import OpenAIRequest, parse_chat, parse_completion
from router.http.openai_response import ResponseBuilder, TokenTexts
from router.http.openapi import openapi_document
from router.http.sse_direct import SseStream
from router.http.sse_template import sse as _sse
from router.requests.direct_write import DirectWrite, WriteFailed
from router.requests.errors import Overloaded, RequestError
from router.requests.frontend import Frontend
from router.requests.health import unhealthy_reason, usable_counts
from router.requests.metrics import CONTENT_TYPE, RouterMetrics

log = logging.getLogger(__name__)
# Request bodies above this are refused (413) before parsing: a bound on memory per request
# that still fits a prompt of a few hundred thousand tokens.
MAX_BODY_BYTES = 16 << 20
# Bodies past this are parsed in a pool process (router/http/large_body.py): parsing holds the
# GIL, and so the router's loop (bench/router_stall_probe.py measures how long).
OFFLOOP_JSON_BYTES = 256 << 10
# On stop, open streams get this long to end (the dispatcher has already failed their runs).
SHUTDOWN_S = 2.0
# Paths that need the API key when one is set (health and metrics stay open to probes).
GUARDED = ("/v1/", "/debug/")
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def _json(body: Any, status: int = 200, headers: dict[str, str] | None = None) -> web.Response:
    return web.Response(text=json.dumps(body, separators=(",", ":")), status=status,
                        content_type="application/json", headers=headers)


class HttpFrontDoor:
    def __init__(self, frontend: Frontend, metrics: RouterMetrics, config: RouterConfig) -> None:
        self.frontend = frontend
        self.metrics = metrics
        self.config = config
        self.texts = TokenTexts(frontend.tokenizer)
        self.started = int(time.time())
        self.port = 0
        self._runner: web.AppRunner | None = None

    async def start(self) -> int:
        cfg = self.config
        app = web.Application(middlewares=[self._errors, self._auth],
                              client_max_size=MAX_BODY_BYTES)
        app.router.add_post("/v1/chat/completions", self._chat)
        app.router.add_post("/v1/completions", self._completions)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/v1/models/{model:.+}", self._model)
        app.router.add_get("/health", self._health)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_get("/openapi.json", self._openapi)
        app.router.add_get("/debug/requests", self._debug_requests)
        ssl_ctx = http_ssl_context(cfg.tls_cert, cfg.tls_key) if cfg.tls_cert else None
        # handler_cancellation: a client that hangs up cancels its handler, which closes the
        # request's stream and so aborts its legs on the workers at once.
        runner = web.AppRunner(app, handler_cancellation=True, access_log=None,
                               shutdown_timeout=SHUTDOWN_S)
        await runner.setup()
        # several frontends share the port (router/control/frontends.py)
        shared = cfg.frontends > 1 or bool(cfg.primary)
        site = web.TCPSite(runner, cfg.listen_host, cfg.http_port, ssl_context=ssl_ctx,
                           backlog=1024, reuse_port=shared or None)
        try:
            await site.start()
        except OSError as e:
            await runner.cleanup()
            raise ValueError(f"--http-port: cannot bind {cfg.listen_host}:{cfg.http_port}: "
                             f"{e.strerror}") from e
        self._runner = runner
        self.port = int(runner.addresses[0][1])
        return self.port

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    # -- middlewares -----------------------------------------------------------------------

    @web.middleware
    async def _errors(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        try:
            return await handler(request)
        except HttpError as e:
            return _json(e.body(), e.status, e.headers)
        except web.HTTPException as e:  # unknown route, wrong method, body too large
            if e.status < 400:
                raise
            err = HttpError(e.status, e.reason or "error", type_="invalid_request_error")
            headers = {k: v for k, v in e.headers.items() if k == "Allow"}
            return _json(err.body(), e.status, headers)
        except Exception:
            log.exception("HTTP %s %s failed", request.method, request.path)
            return _json(HttpError(500, "internal error", type_="server_error").body(), 500)

    @web.middleware
    async def _auth(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        if request.path.startswith(GUARDED) and not bearer_ok(
                request.headers.get("Authorization"), self.config.api_key):
            raise HttpError(401, UNAUTHENTICATED_MESSAGE, type_="authentication_error",
                            code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
        return await handler(request)

    # -- informational routes --------------------------------------------------------------

    def _model_card(self) -> dict[str, Any]:
        return {"id": self.frontend.model_id, "object": "model", "created": self.started,
                "owned_by": "pdserve",
                "max_model_len": self.frontend.registry.max_model_len()}

    async def _models(self, request: web.Request) -> web.Response:
        return _json({"object": "list", "data": [self._model_card()]})

    async def _model(self, request: web.Request) -> web.Response:
        name = request.match_info["model"]
        if name not in self.frontend.model_names:
            raise self._unknown_model(name)
        return _json(self._model_card())

    async def _health(self, request: web.Request) -> web.Response:
        reg = self.frontend.registry
        reason = unhealthy_reason(reg)
        body = {"status": "ok" if reason is None else "unavailable", "reason": reason,
                "usable_workers": usable_counts(reg)}
        return _json(body, 200 if reason is None else 503)

    async def _metrics(self, request: web.Request) -> web.Response:
        return web.Response(body=self.metrics.render(), headers={"Content-Type": CONTENT_TYPE})

    async def _openapi(self, request: web.Request) -> web.Response:
        return _json(openapi_document([self.frontend.model_id], bool(self.config.api_key),
                                      self.frontend.registry.max_model_len()))

    async def _debug_requests(self, request: web.Request) -> web.Response:
        rows = [{"request_id": r.request_id, "state": r.state.name, "age_s": round(r.age_s, 3),
                 "producer": r.producer, "consumer": r.consumer, "colocated": r.colocated,
                 "tokens_streamed": r.tokens_streamed}
                for r in self.frontend.dispatcher.requests()]
        return _json({"object": "list", "data": rows})

    def _unknown_model(self, name: str) -> HttpError:
        return HttpError(404, f"model: {name!r} does not exist (served: "
                              f"{self.frontend.model_id!r})", param="model",
                         code="model_not_found")

    # -- generation ------------------------------------------------------------------------

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, await self._parse(request, parse_chat))

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, await self._parse(request, parse_completion))

    async def _parse(self, request: web.Request,
                     parse: Callable[..., OpenAIRequest]) -> OpenAIRequest:
        raw = await request.read()
        chat = parse is parse_chat
        # the router's --max-tokens-limit, so both doors refuse with the same words
        parse = functools.partial(parse, max_tokens_limit=self.frontend.max_tokens_limit)
        try:
            if len(raw) > OFFLOOP_JSON_BYTES:  # see router/http/large_body.py
                return await self.frontend.tokenize_pool.run(len(raw), functools.partial(
                    parse_large_body, raw, parse, self.frontend.registry.max_model_len()))
            try:
                body = json.loads(raw)
            except (ValueError, UnicodeDecodeError) as e:
                raise HttpError(400, f"body: not valid JSON ({e})", param="body") from e
            return parse(body)
        except Overloaded as e:  # the pool is full: 429, not counted as invalid
            raise from_request_error(e, chat) from e
        except RequestError as e:  # the length bound, in the pool
            self.metrics.refused("http", e.code.name)
            raise from_request_error(e, chat) from e
        except HttpError:
            self.metrics.refused("http", "invalid_argument")  # as the router's own refusals
            raise

    async def _generate(self, request: web.Request, req: OpenAIRequest) -> web.StreamResponse:
        received_ns = time.time_ns()
        if req.model is not None and req.model not in self.frontend.model_names:
            self.metrics.refused("http", "not_found")
            raise self._unknown_model(req.model)
        builder = ResponseBuilder(req, self.frontend.model_id, self.texts)
        # a stream's text chunks may be written from the worker's batch (sse_direct.py)
        stream = SseStream(builder) if req.stream else None
        writer = DirectWrite(stream, takes_first=False) if stream is not None else None
        gen: AsyncGenerator[router_pb2.GenerateResponse, None] = self.frontend.generate(
            req.generate, received_ns, "http", fill_max_tokens=req.chat, direct=writer)
        async with contextlib.aclosing(gen):
            try:
                first = await anext(gen)
            except RequestError as e:
                raise from_request_error(e, req.chat, req.structured_field) from e
            if stream is not None and writer is not None:
                return await self._stream(request, stream, writer, first, gen)
            builder.add(first)
            async for resp in gen:
                builder.add(resp)
        if builder.error:
            raise HttpError(500, builder.error, type_="server_error")
        return _json(builder.final())

    async def _stream(self, request: web.Request, stream: SseStream, writer: DirectWrite,
                      first: router_pb2.GenerateResponse,
                      rest: AsyncIterator[router_pb2.GenerateResponse]) -> web.StreamResponse:
        """Writes what comes out of ``rest``; a decoding request's text chunks may also be
        written directly (``writer``), and every write here waits for those first, so the
        chunks leave in the order the responses came."""
        builder = stream.builder
        out = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                          "Cache-Control": "no-cache"})
        await out.prepare(request)
        stream.out = out
        try:
            builder.start(first)
            if builder.req.chat:
                await out.write(_sse(builder.role_chunk()))
            resp: router_pb2.GenerateResponse | None = first
            while resp is not None:
                if (data := stream.chunk(resp)) is not None:
                    await writer.wait_idle()
                    await out.write(data)
                resp = await anext(rest, None)
            await writer.wait_idle()
            if builder.error:
                # Headers are gone: the error travels as an event, like OpenAI's.
                await out.write(_sse(HttpError(500, builder.error,
                                               type_="server_error").body()))
            elif builder.req.include_usage:
                await out.write(_sse(builder.usage_chunk()))
            await out.write(b"data: [DONE]\n\n")
            await out.write_eof()
        except (ConnectionError, WriteFailed):
            pass  # the client left; closing the stream (aclosing) aborts the request
        return out
