"""Several connections to one router from one client process, streams dealt round-robin.

A router's frontends (``--frontends N``) share its port by SO_REUSEPORT, which spreads
connections, not streams: a client on one connection reaches one frontend, however many
run. gRPC multiplexes every stream of a process onto one connection, even over several
channels (they share the process's subchannel pool; ``GrpcBackend`` opts out of it), so
``pdserve bench --connections N`` (and each client process of bench/serving_cpu_bench.py,
``--connections-per-client``) opens N backends, each its own connection, and deals the
requests over them in turn, as N clients would.
"""

from __future__ import annotations

import itertools

from deploy.benchmark.backend import Backend, SamplingChoice
from deploy.benchmark.record import RequestRecord
from deploy.benchmark.workload import RequestSpec


class SpreadBackend(Backend):
    def __init__(self, backends: list[Backend]) -> None:
        if not backends:
            raise ValueError("SpreadBackend: needs at least one backend")
        self.backends = backends
        self.name = backends[0].name
        self._next = itertools.cycle(backends)

    async def open(self) -> None:
        for b in self.backends:
            await b.open()

    async def close(self) -> None:
        for b in self.backends:
            await b.close()

    async def workers(self) -> int:
        return await self.backends[0].workers()

    async def send(self, spec: RequestSpec, rec: RequestRecord,
                   sampling: SamplingChoice) -> None:
        await next(self._next).send(spec, rec, sampling)
