"""One request in flight as ClusterStatus and GET /debug/requests list it."""

from __future__ import annotations

from dataclasses import dataclass

from router.requests.run_phase import RunPhase


@dataclass(frozen=True)
class RequestInfo:
    """One request as listed by ClusterStatus and GET /debug/requests."""

    request_id: str
    state: RunPhase
    age_s: float  # since the router received it
    producer: str  # worker ids of its legs ("" when none yet, or colocated)
    consumer: str
    colocated: str
    tokens_streamed: int  # tokens handed to the client so far
