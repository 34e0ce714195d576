"""The seam between the load generator and a serving API: send one request, fill a record."""

from __future__ import annotations

from dataclasses import dataclass

from deploy.benchmark.record import RequestRecord
from deploy.benchmark.workload import RequestSpec


@dataclass(frozen=True)
class SamplingChoice:
    ignore_eos: bool = False
    temperature: float = 0.0  # greedy, like vLLM's benchmark default
    timeout_s: float = 600.0  # per request


class Backend:
    """Subclasses stream one request and record it; they never raise for a failed request."""

    name = "base"

    async def open(self) -> None: ...

    async def close(self) -> None: ...

    async def workers(self) -> int:
        """Workers serving behind this endpoint (0 when the API cannot tell)."""
        return 0

    async def send(self, spec: RequestSpec, rec: RequestRecord,
                   sampling: SamplingChoice) -> None:
        raise NotImplementedError
