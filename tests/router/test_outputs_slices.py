"""A large Outputs batch is handed on in slices (router/requests/worker_outputs.py): work
that becomes ready while a consumer's step of many requests is being written to their
clients (a producer's token 0, whose hold the router's promise bounds) runs between
slices, not after the whole batch; every entry still reaches its leg, in order."""

from __future__ import annotations

import asyncio
from typing import Any

import grpc
from pdserve.v1 import worker_pb2

from router.requests.worker_outputs import SLICE, WorkerOutputs

N = 8 * SLICE


class _Call:
    """An Outputs call that gives the subscription batch, then one step of N requests."""

    def __init__(self, batches: list[worker_pb2.OutputBatch]) -> None:
        self._batches = batches

    def __aiter__(self) -> Any:
        return self._gen()

    async def _gen(self) -> Any:
        for b in self._batches:
            yield b
        await asyncio.sleep(3600)

    def cancel(self) -> None:
        pass


class _Stub:
    def __init__(self, call: _Call) -> None:
        self._call = call

    def Outputs(self, request: worker_pb2.OutputsRequest) -> _Call:  # noqa: N802 - gRPC's
        return self._call


class _Leg:
    def __init__(self, handed: list[str], on_first: Any = None) -> None:
        self.handed = handed
        self.on_first = on_first

    def on_tokens(self, tokens: worker_pb2.Tokens) -> None:
        self.handed.append(tokens.request_id)
        if self.on_first is not None:
            self.on_first()

    def on_reserved(self, reserved: worker_pb2.Reserved) -> None:
        pass

    def on_outputs_broken(self, code: grpc.StatusCode | None, message: str) -> None:
        self.handed.append(f"broken: {message}")  # seen by the handed-on assertions


def _step(n: int) -> worker_pb2.OutputBatch:
    b = worker_pb2.OutputBatch(seq=1)
    for i in range(n):
        t = b.tokens.add()
        t.request_id = f"r{i}"
        t.token_ids.append(100 + i)
    return b


def test_work_ready_mid_batch_runs_between_slices_and_every_entry_arrives() -> None:
    async def main() -> None:
        loop = asyncio.get_running_loop()
        handed: list[str] = []
        seen_at: list[int] = []  # entries handed on when the other work ran
        call = _Call([worker_pb2.OutputBatch(seq=0), _step(N)])
        outs = WorkerOutputs("c0", _Stub(call))  # type: ignore[arg-type]
        # the first entry's write makes other work ready, as a token 0 read would
        outs.route("r0", _Leg(handed, lambda: loop.call_soon(
            lambda: seen_at.append(len(handed)))))
        for i in range(1, N):
            outs.route(f"r{i}", _Leg(handed))
        for _ in range(200):
            if outs.seq == 1:
                break
            await asyncio.sleep(0)
        assert handed == [f"r{i}" for i in range(N)]  # all of them, in the batch's order
        assert outs.seq == 1
        # it ran after the first slice: the whole batch did not hold it
        assert seen_at == [SLICE], seen_at
        outs.close()

    asyncio.run(main())


def test_a_route_ended_by_an_earlier_slice_is_not_handed_more() -> None:
    """A leg unrouted while the loop ran between slices gets nothing of the later ones
    (its entries count as orphans, aborted once on the worker)."""
    async def main() -> None:
        handed: list[str] = []
        call = _Call([worker_pb2.OutputBatch(seq=0), _step(2 * SLICE)])
        outs = WorkerOutputs("c0", _Stub(call))  # type: ignore[arg-type]
        aborted: list[str] = []
        outs._orphaned = aborted.append  # type: ignore[method-assign]
        last = f"r{2 * SLICE - 1}"
        outs.route("r0", _Leg(handed, lambda: asyncio.get_running_loop().call_soon(
            outs.unroute, last)))
        for i in range(1, 2 * SLICE):
            outs.route(f"r{i}", _Leg(handed))
        for _ in range(200):
            if outs.seq == 1:
                break
            await asyncio.sleep(0)
        assert handed == [f"r{i}" for i in range(2 * SLICE - 1)]
        assert aborted == [last]
        outs.close()

    asyncio.run(main())
