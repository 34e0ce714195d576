"""pdserve's model-execution core: config, requests, blocks, scheduler, runner, models, sampler.

Importing the package is cheap and imports no torch; the heavy parts load on first use so
torch-free code (the router, transfer handshakes) can import ``engine.kv_layout`` and
``engine.tokenizer``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from engine.llm import LLM
    from engine.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams"]


def __getattr__(name: str) -> Any:
    if name == "LLM":
        from engine.llm import LLM

        return LLM
    if name == "SamplingParams":
        from engine.sampling_params import SamplingParams

        return SamplingParams
    raise AttributeError(name)
