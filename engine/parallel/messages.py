"""The rank channel's messages: one type per direction and kind, through the checked codec
(``engine.codec``), so a malformed frame names its kind and field.

Rank 0 -> follower (the follower's stdin): ``KvStart``, ``GraphsStart``, one ``StepPlan``,
``GraphStep`` or (data-parallel attention) ``DPPlan`` per step, ``KvCopy`` (join a block
copy from the attention group's first rank), ``Attach`` (start a rank side),
``SideMessage`` (for the rank side), ``Stop``. Follower -> rank 0 (its channel
pipe): ``Hello``, ``KvReady``, ``GraphsReady``, ``Attached`` / ``AttachFailed``,
``SideReport``. A rank side's own messages travel as bytes in ``Attach.args``,
``SideMessage``, ``Attached.info`` and ``SideReport``: the engine does not know them, the
side checks them with a codec of its own (``transfer.tp_messages``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from engine.codec import Codec
from engine.parallel.dp_plan import DPPlan
from engine.parallel.graph_step import GraphStep
from engine.parallel.step_plan import StepPlan

# ---- rank 0 -> follower ------------------------------------------------------------------


@dataclass(frozen=True)
class KvStart:
    """Allocate the KV cache (rank 0's shape: this rank's heads) and report ready."""

    KIND: ClassVar[str] = "kv"
    shape: tuple[int, ...]
    dtype: str  # a torch dtype's name, e.g. "bfloat16"
    kv_scales: tuple[float, ...] = ()  # rank 0's float8 KV scales (engine/kv_scales.py)


@dataclass(frozen=True)
class GraphsStart:
    """Build the decode buffers and capture the same graphs as rank 0."""

    KIND: ClassVar[str] = "graphs"
    max_batch: int
    max_blocks: int
    use_graphs: bool


@dataclass(frozen=True)
class KvCopy:
    """Join the broadcast of these KV blocks from the attention group's first rank
    (engine.parallel.block_copy): a replicated latent it received for a request."""

    KIND: ClassVar[str] = "kv-copy"
    block_ids: tuple[int, ...]


@dataclass(frozen=True)
class Attach:
    """Start a rank side: ``factory`` is ``"module:function"``; ``args`` its own encoding."""

    KIND: ClassVar[str] = "attach"
    factory: str
    args: bytes


@dataclass(frozen=True)
class SideMessage:
    KIND: ClassVar[str] = "side"
    body: bytes


@dataclass(frozen=True)
class Stop:
    KIND: ClassVar[str] = "stop"


# ---- follower -> rank 0 ------------------------------------------------------------------


@dataclass(frozen=True)
class Hello:
    """The follower started (it joins the group next)."""

    KIND: ClassVar[str] = "hello"


@dataclass(frozen=True)
class KvReady:
    """Weights loaded and KV allocated."""

    KIND: ClassVar[str] = "ready"


@dataclass(frozen=True)
class GraphsReady:
    KIND: ClassVar[str] = "graphs-ready"


@dataclass(frozen=True)
class Attached:
    KIND: ClassVar[str] = "attached"
    info: bytes  # what the rank side's info() returned


@dataclass(frozen=True)
class AttachFailed:
    KIND: ClassVar[str] = "attach-failed"
    error: str


@dataclass(frozen=True)
class SideReport:
    KIND: ClassVar[str] = "report"
    body: bytes


ToFollower = (KvStart | GraphsStart | StepPlan | GraphStep | DPPlan | KvCopy | Attach
              | SideMessage | Stop)
FromFollower = Hello | KvReady | GraphsReady | Attached | AttachFailed | SideReport

TO_FOLLOWER = Codec((KvStart, GraphsStart, StepPlan, GraphStep, DPPlan, KvCopy, Attach,
                     SideMessage, Stop))
FROM_FOLLOWER = Codec((Hello, KvReady, GraphsReady, Attached, AttachFailed, SideReport))
