"""What each side keeps on the I/O thread: per request (a record) and per peer.

The sender talks to consumers through ``Conn``s (one DEALER each) and keeps ``SendRecord``s;
the receiver hears producers as ``Peer``s on its ROUTER and keeps ``RecvRecord``s. The
shared part of a record (``Record``) is what ``NetSide`` ends, times out and drains.

Producer and consumer of different TP: one request's record may span several peers. A
sender's record has one ``Leg`` per consumer rank it pushes to, a receiver's one
``RecvPart`` per producer rank it takes heads from (``transfer.tp_plan``); the request
completes when every leg / part did, and ends (cancel, failure) as a whole.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from engine.kv_layout import KVLayout
from transfer.head_cut import HeadCut
from transfer.tp_plan import Part
from transfer.types import TransferError, TransferNotice, TransferStatus
from transfer.wire import Message

MAX_TAG_SEQ = 1 << 32  # tags are (session << 32) | seq

P = TypeVar("P")


@dataclass
class Record(Generic[P]):
    """One request's transfer as one side sees it."""

    request_id: str
    deadline: float  # time.monotonic() value
    status: TransferStatus = TransferStatus.PENDING
    ops: list[object] = field(default_factory=list)  # posted data-plane ops not completed
    runs: int = 0  # runs sent (sender) / landed (receiver)
    total: int | None = None  # runs in the whole transfer, known at finish
    notice: TransferNotice | None = None
    ending: tuple[TransferStatus, str] | None = None  # terminal status once ops drain
    ending_since: float = 0.0

    def drained(self) -> bool:
        """Nothing of this side touches the request's blocks any more."""
        return not self.ops

    def peers(self) -> list[P]:
        """Every peer this record talks to."""
        return []


@dataclass
class Conn:
    """The sender's connection to one consumer."""

    address: str  # the consumer's advertised control address
    sock: Any  # zmq DEALER
    session: int  # random 32 bits: the high half of every tag of this connection
    ready: Future[None]  # resolved by WELCOME / REJECT / the connect deadline
    opened: float  # when the HELLO went out (the handshake deadline counts from here)
    last_heard: float
    last_ping: float = 0.0
    handle: object | None = None  # data-plane peer, after WELCOME
    welcomed: bool = False  # WELCOME read (its plane info may still be being vetted)
    monitor: Any = None  # reports a failed ZMQ (CURVE) handshake until WELCOME
    remote_blocks: int = 0  # the consumer's pool size, to refuse out-of-range dst ids
    # the consumer rank's heads we send (tp_plan), and how they lie in both pools (None:
    # whole blocks); unset while handshaking
    serves: str | None = None  # why this consumer rank takes none of our heads, if so
    cut: HeadCut | None = None
    seq: int = 0
    outbox: list[Message] = field(default_factory=list)  # sent at the end of the turn
    # pushes / finishes made while the handshake runs, replayed in order on WELCOME
    waiting: list[Callable[[], None]] = field(default_factory=list)

    def next_tag(self) -> int:
        self.seq += 1
        if self.seq >= MAX_TAG_SEQ:
            raise TransferError(f"{self.address}: tag space exhausted; reconnect")
        return (self.session << 32) | self.seq


@dataclass
class Leg:
    """A sender record's share going to one consumer (rank)."""

    conn: Conn
    runs: int = 0  # runs sent on this leg
    acked: bool = False  # the consumer acknowledged everything
    # on a pull plane a record this side ended keeps its source blocks until the consumer
    # answered (it may still be reading them)
    await_peer: bool = False
    quiet: bool = False  # the consumer ended it itself (or is gone): no CANCEL to it


@dataclass
class SendRecord(Record[Conn]):
    legs: dict[str, Leg] = field(default_factory=dict)  # by consumer address, push order

    def drained(self) -> bool:
        return not self.ops and not any(leg.await_peer for leg in self.legs.values())

    def peers(self) -> list[Conn]:
        return [leg.conn for leg in self.legs.values()]

    def leg_of(self, conn: Conn) -> Leg | None:
        leg = self.legs.get(conn.address)
        return leg if leg is not None and leg.conn is conn else None


@dataclass
class Peer:
    """A producer that passed the handshake on the receiver's ROUTER."""

    ident: bytes  # its ZMQ identity on our ROUTER
    name: str  # its self-given name, for errors
    where: str  # its network address (for log lines)
    handle: object  # data-plane peer
    remote_blocks: int  # its pool size: source runs must lie inside it
    last_heard: float
    layout: KVLayout | None = None  # its rank's layout (TP size and rank: which heads)
    cut: HeadCut | None = None  # how its part of our heads lies in both pools (None: whole)
    last_ping: float = 0.0
    last_tag: int = -1  # tags only move forward: a replayed PUSH is refused
    drains: list[object] = field(default_factory=list)  # receives of unwanted runs


@dataclass
class RecvPart:
    """What one producer rank sends of a receiver record."""

    peer: Peer
    posted: int = 0  # runs announced and posted
    total: int | None = None  # runs in its share, known at its FINISH
    notice: TransferNotice | None = None
    quiet: bool = False  # it ended the request itself (or is gone): no CANCEL to it
    seen_ns: int = 0  # when the frame carrying its FINISH was read (Unix ns, for timing)


@dataclass
class RecvRecord(Record[Peer]):
    dst: frozenset[int] = frozenset()  # the reserved blocks
    source_tp: int = 1  # TP size of the producer the parts come from
    sources: dict[int, Part] = field(default_factory=dict)  # producer rank -> its heads
    parts: dict[int, RecvPart] = field(default_factory=dict)  # producer rank -> progress
    stop_to: list[Peer] = field(default_factory=list)  # told STOPPED once our reads drained
    notice_seen_ns: int = 0  # the last part's FINISH read (Unix ns), set when all landed

    def peers(self) -> list[Peer]:
        return [p.peer for p in self.parts.values()]

    def part_of(self, peer: Peer) -> RecvPart | None:
        return next((p for p in self.parts.values() if p.peer is peer), None)
