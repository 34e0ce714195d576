"""What rank 0 of a TP worker and each follower rank's transfer endpoint say to each other:
one type per direction and kind, through the checked codec (``engine.codec``). They travel
as the bytes of the engine's rank channel (``engine.parallel.messages``: ``Attach.args``,
``SideMessage``, ``Attached.info``, ``SideReport``), behind the step plans sent before them.

Rank 0 -> rank side: ``RankSideArgs`` (once, to start it), then ``PushCmd``,
``FinishCmd``, ``CancelCmd``, ``ReleaseCmd`` (producer) or ``ExpectCmd``, ``CancelCmd``,
``ReleaseCmd`` (consumer). Rank side -> rank 0: ``RankSideInfo`` (once, its answer to the
args), then ``UpdateReport`` once per terminal record, ``ExpectedReport`` per expect,
``StatsReport`` whenever its counters changed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from engine.codec import Codec
from engine.kv_layout import KVLayout
from transfer.types import TransferConfig, TransferNotice, TransferStatus

# ---- rank 0 -> rank side -----------------------------------------------------------------


@dataclass(frozen=True)
class RankSideArgs:
    """How a follower rank builds its endpoint. ``layout.tp_rank`` is rank 0's: each rank
    puts its own. ``base_port`` > 0: a fixed KV port, rank r listens on base_port + r."""

    KIND: ClassVar[str] = "args"
    kind: str  # "producer" | "consumer"
    name: str
    layout: KVLayout
    transfer: TransferConfig
    base_port: int = 0


@dataclass(frozen=True)
class PushCmd:
    """Producer: connect to each address and push the run to it."""

    KIND: ClassVar[str] = "push"
    rid: str
    addresses: tuple[str, ...]  # the consumer ranks this rank sends heads to
    src: tuple[int, ...]
    dst: tuple[int, ...]
    deadline: float | None  # time.monotonic(): the ranks share one host clock


@dataclass(frozen=True)
class FinishCmd:
    KIND: ClassVar[str] = "finish"
    rid: str
    notice: TransferNotice


@dataclass(frozen=True)
class CancelCmd:
    KIND: ClassVar[str] = "cancel"
    rid: str
    reason: str


@dataclass(frozen=True)
class ReleaseCmd:
    KIND: ClassVar[str] = "release"
    rid: str


@dataclass(frozen=True)
class ExpectCmd:
    """Consumer: reserve the blocks; answered by ExpectedReport."""

    KIND: ClassVar[str] = "expect"
    rid: str
    dst: tuple[int, ...]
    deadline: float | None
    source_tp: int | None


# ---- rank side -> rank 0 -----------------------------------------------------------------


@dataclass(frozen=True)
class RankSideInfo:
    KIND: ClassVar[str] = "info"
    address: str  # a consumer rank's KV address; "" on a producer rank


@dataclass(frozen=True)
class UpdateReport:
    KIND: ClassVar[str] = "update"
    rid: str
    status: TransferStatus
    notice: TransferNotice | None
    error: str | None
    notice_seen_ns: int = 0  # TransferUpdate's handoff stamps (consumer rank, DONE only)
    kv_done_ns: int = 0


@dataclass(frozen=True)
class ExpectedReport:
    KIND: ClassVar[str] = "expected"
    rid: str


@dataclass(frozen=True)
class StatsReport:
    KIND: ClassVar[str] = "stats"
    malformed: int
    rejected: int
    payload_bytes: int


ToRank = RankSideArgs | PushCmd | FinishCmd | CancelCmd | ReleaseCmd | ExpectCmd
FromRank = RankSideInfo | UpdateReport | ExpectedReport | StatsReport

TO_RANK = Codec((RankSideArgs, PushCmd, FinishCmd, CancelCmd, ReleaseCmd, ExpectCmd))
FROM_RANK = Codec((RankSideInfo, UpdateReport, ExpectedReport, StatsReport))
