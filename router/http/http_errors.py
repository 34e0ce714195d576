"""OpenAI-style HTTP errors: ``{"error": {"message", "type", "param", "code"}}`` with the
status OpenAI clients map to their exception types (400, 401, 404, 429, 503, 500).

Router refusals (``RequestError``) carry a gRPC code and a message that starts with the
internal field path (``sampling.temperature: ...``, ``chat.messages[0].role: ...``); here
that path is renamed to the OpenAI request's field so ``param`` names what the client sent.
"""

from __future__ import annotations

import math
import re

import grpc

from router.requests.errors import Overloaded, RequestError

# gRPC code -> (HTTP status, OpenAI error type, error code)
_STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: (400, "invalid_request_error", None),
    grpc.StatusCode.OUT_OF_RANGE: (400, "invalid_request_error", None),
    grpc.StatusCode.UNAUTHENTICATED: (401, "authentication_error", "invalid_api_key"),
    grpc.StatusCode.NOT_FOUND: (404, "invalid_request_error", "not_found"),
    grpc.StatusCode.ALREADY_EXISTS: (409, "invalid_request_error", "conflict"),
    grpc.StatusCode.RESOURCE_EXHAUSTED: (429, "rate_limit_error", "overloaded"),
    grpc.StatusCode.UNAVAILABLE: (503, "service_unavailable_error", "no_workers"),
}
# Internal field path prefix -> the OpenAI field it came from.
_RENAMES = (("sampling.", ""), ("chat.messages", "messages"), ("chat.", "messages."),
            ("prompt_token_ids", "prompt"), ("input", "prompt"))
_PARAM = re.compile(r"^([A-Za-z_][\w.\[\]]*): ")


class HttpError(Exception):
    def __init__(self, status: int, message: str, *, type_: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type_
        self.param = param
        self.code = code
        self.headers = headers or {}

    def __reduce__(self) -> tuple[object, ...]:
        # raised in a pool process that parses a large body (router/http/large_body.py)
        return (_rebuild, (self.status, self.message, self.type, self.param, self.code,
                           self.headers))

    def body(self) -> dict[str, object]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}


def bad_field(param: str, why: str) -> HttpError:
    """400 naming the field: ``param`` is what the client sent (e.g. ``messages[1].role``)."""
    return HttpError(400, f"{param}: {why}", param=param)


def rename_fields(message: str, chat: bool) -> tuple[str, str | None]:
    """The message with its leading internal field path renamed, and that field."""
    m = _PARAM.match(message)
    if m is None:
        return message, None
    path = m.group(1)
    for old, new in _RENAMES:
        if path.startswith(old):
            path = new + path[len(old):]
            break
    if path == "prompt" and chat:
        path = "messages"
    return path + message[m.end(1):], path


def from_request_error(e: RequestError, chat: bool) -> HttpError:
    status, type_, code = _STATUS.get(e.code, (500, "server_error", None))
    message, param = rename_fields(e.message, chat)
    headers = {}
    if isinstance(e, Overloaded):
        # Retry-After is whole seconds (RFC 9110); never 0, which invites a hot retry loop.
        headers["Retry-After"] = str(max(1, math.ceil(e.retry_after_s)))
    if status != 400:
        param = None if status != 404 else param
    return HttpError(status, message, type_=type_, param=param, code=code, headers=headers)


def _rebuild(status: int, message: str, type_: str, param: str | None, code: str | None,
             headers: dict[str, str]) -> HttpError:
    return HttpError(status, message, type_=type_, param=param, code=code, headers=headers)
