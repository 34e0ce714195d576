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
    """The producer's token 0."""

    token0: worker_pb2.Token0


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


@dataclass(frozen=True)
class TokensRead:
    """Tokens of the decoding leg (consumer or colocated)."""

    tokens: worker_pb2.Tokens


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


Event = (Token0Read | TransferRead | ProducerEnded | Reserved | TokensRead | DecodeEnded
         | LegFailed | Aborted | Dropped | Failed | TimedOut)
# ended from outside: a queued run sees these at once (``RequestRun.stopped``)
STOPS = (Aborted, Failed)
