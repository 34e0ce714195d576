"""The operators' ``pdserve.v1.Admin`` service (guarded by the API key, like Router)."""

from __future__ import annotations

import asyncio
import math
from collections.abc import AsyncIterator

import grpc
from pdserve.v1 import router_pb2, router_pb2_grpc

from router.control.registry import Registry
from router.control.role_change import (
    DEFAULT_STEP_TIMEOUT_S,
    RoleChanger,
    SplitError,
    plan_split,
    progress_msg,
)


class AdminServicer(router_pb2_grpc.AdminServicer):
    def __init__(self, registry: Registry, changer: RoleChanger) -> None:
        self.registry = registry
        self.changer = changer

    async def ChangeSplit(self, request: router_pb2.ChangeSplitRequest,
                          context: grpc.aio.ServicerContext
                          ) -> AsyncIterator[router_pb2.ChangeSplitProgress]:
        timeout = request.step_timeout_s or DEFAULT_STEP_TIMEOUT_S
        if not (math.isfinite(timeout) and timeout > 0):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"step_timeout_s: must be > 0, got {request.step_timeout_s}")
        if self.changer.running:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                "a role change is already running")
        try:
            steps = plan_split(self.registry, request.producers, request.consumers,
                               request.colocated)
        except SplitError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
            raise  # unreachable: abort raises
        queue: asyncio.Queue[router_pb2.ChangeSplitProgress] = asyncio.Queue()
        self.changer.start(steps, timeout, queue.put_nowait)
        for step in steps:
            yield progress_msg(step, "planned", f"{step.describe()}: planned")
        while True:
            msg = await queue.get()
            yield msg
            if msg.done:
                return
