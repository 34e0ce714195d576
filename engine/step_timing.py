"""When an engine step was entered, launched and read: for a caller that paces its
launches (worker/launch_pacer.py). No torch here: the worker's gRPC process imports the
pacer's module through the engine loop's."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class StepTiming:
    """Wall-clock marks (time.time_ns) of one LLMEngine.step() call: entered; its step
    launched (0: it launched none); the step it read was launched and read (0: it read
    none). A GPU step runs from max(the previous read, its launch) to its read."""

    entered_ns: int = 0
    launched_ns: int = 0
    read_launched_ns: int = 0
    read_ns: int = 0
