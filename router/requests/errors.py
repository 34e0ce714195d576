"""How the router refuses a request: an exception carrying the gRPC status to refuse it
with, which each front door maps to its own (gRPC code, HTTP status)."""

from __future__ import annotations

from typing import Any

import grpc


class RequestError(Exception):
    """A request the router refuses, with the gRPC status to refuse it with."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


    def __reduce__(self) -> tuple[Any, ...]:
        # raised in a tokenize pool process and re-raised here (pickled with its code)
        return (RequestError, (self.code, self.message))


def invalid(message: str) -> RequestError:
    return RequestError(grpc.StatusCode.INVALID_ARGUMENT, message)


class Overloaded(RequestError):
    """The router is at its queue bound; ``retry_after_s`` is the hint sent to the client."""

    def __init__(self, message: str, retry_after_s: float) -> None:
        super().__init__(grpc.StatusCode.RESOURCE_EXHAUSTED, message)
        self.retry_after_s = retry_after_s
