"""What reaches a request's run: one frozen record per kind of report, from its legs
(``router.requests.legs``) and from outside (Router.Abort, a dropped worker, shutdown, its
own timeouts). The run's loops match on the type; each field is typed, so nothing is read
out of an untyped payload by position."""

from __future__ import annotations

from dataclasses import dataclass

import grpc
from pdserve.v1 import worker_pb2

from router.control.registry import WorkerInfo


@dataclass(frozen=True)
class Token0Read:
    """The producer's token 0, and when the router read the message carrying it (Unix ns)."""

    token0: worker_pb2.Token0
    read_ns: int = 0


@dataclass(frozen=True)
class Token0Written:
    """Token 0 went to the client from the producer's batch (``RequestRun``'s direct
    write): the client loop only catches up (tokens held for it go out next)."""


@dataclass(frozen=True)
class TransferRead:
    """The producer's KV transfer result: its part is done."""

    result: worker_pb2.TransferResult


@dataclass(frozen=True)
class ProducerEnded:
    """The producer closed its stream."""


@dataclass(frozen=True)
class Reserved:
    """The consumer's reserved blocks, addressed for the producer."""

    dest: worker_pb2.KVDestination


class TokensRead:
    """Tokens of the decoding leg (consumer or colocated).

    One is built per token message, so it is a plain slotted class: a frozen dataclass's
    ``__init__`` goes through ``object.__setattr__`` (about 3x the cost). It is never
    mutated after construction all the same."""

    __slots__ = ("tokens",)
    __match_args__ = ("tokens",)

    def __init__(self, tokens: worker_pb2.Tokens) -> None:
        self.tokens = tokens

    def __eq__(self, other: object) -> bool:
        return type(other) is TokensRead and other.tokens == self.tokens

    __hash__ = None  # type: ignore[assignment]  # as a dataclass with eq: unhashable

    def __repr__(self) -> str:
        return f"TokensRead(tokens={self.tokens!r})"


@dataclass(frozen=True)
class DecodeEnded:
    """The consumer's or colocated worker's stream ended."""


@dataclass(frozen=True)
class LegFailed:
    """A leg's call failed; ``code`` is None when it was no gRPC status."""

    worker: WorkerInfo
    code: grpc.StatusCode | None
    message: str


@dataclass(frozen=True)
class Aborted:
    """Router.Abort."""


@dataclass(frozen=True)
class Dropped:
    """The registry dropped one of the request's workers."""

    worker: WorkerInfo
    reason: str


@dataclass(frozen=True)
class Failed:
    """Failed from outside, e.g. the router shutting down."""

    message: str


@dataclass(frozen=True)
class TimedOut:
    """The run waited longer than its bound on ``worker``."""

    worker: WorkerInfo
    message: str


Event = (Token0Read | Token0Written | TransferRead | ProducerEnded | Reserved | TokensRead
         | DecodeEnded | LegFailed | Aborted | Dropped | Failed | TimedOut)
# ended from outside: a queued run sees these at once (``RequestRun.stopped``)
STOPS = (Aborted, Failed)
