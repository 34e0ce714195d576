"""The consumer's and the colocated worker's engine-process factories, named in the worker's
EngineSpec (module-level functions pickle by reference into the spawned engine process)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from worker.role import Emit, RoleHandler

if TYPE_CHECKING:  # the engine (torch) loads in the engine process only, never the gRPC one
    from engine.llm_engine import LLMEngine
    from worker.engine_loop import EngineSpec


def make_consumer_handler(engine: LLMEngine, emit: Emit, spec: EngineSpec) -> RoleHandler:
    # imported here: the transfer backend loads in the engine process, not the gRPC one
    from consumer.handler import ConsumerHandler

    return ConsumerHandler(engine, emit, spec.transfer, spec.reservation_s)


def make_colocated_handler(engine: LLMEngine, emit: Emit, spec: EngineSpec) -> RoleHandler:
    from consumer.colocated import ColocatedHandler

    return ColocatedHandler(engine, emit)
