"""The producer's engine-process factory, named in the worker's EngineSpec (a module-level
function pickles by reference into the spawned engine process)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from worker.role import Emit, RoleHandler

if TYPE_CHECKING:  # the engine (torch) loads in the engine process only, never the gRPC one
    from engine.llm_engine import LLMEngine
    from worker.engine_loop import EngineSpec


def make_producer_handler(engine: LLMEngine, emit: Emit, spec: EngineSpec) -> RoleHandler:
    # imported here: the transfer backend loads in the engine process, not the gRPC one
    from producer.handler import ProducerHandler

    return ProducerHandler(engine, emit, spec.transfer, spec.lease_s)
