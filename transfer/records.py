"""What each side keeps on the I/O thread: per request (a record) and per peer.

The sender talks to consumers through ``Conn``s (one DEALER each) and keeps ``SendRecord``s;
the receiver hears producers as ``Peer``s on its ROUTER and keeps ``RecvRecord``s. The
shared part of a record (``Record``) is what ``NetSide`` ends, times out and drains.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from transfer.types import TransferError, TransferNotice, TransferStatus
from transfer.wire import Message

MAX_TAG_SEQ = 1 << 32  # tags are (session << 32) | seq

P = TypeVar("P")


@dataclass
class Record(Generic[P]):
    """One request's transfer as one side sees it."""

    request_id: str
    deadline: float  # time.monotonic() value
    peer: P | None = None  # the connection / producer it talks to
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
class SendRecord(Record[Conn]):
    acked: bool = False  # the consumer acknowledged everything
    # on a pull plane a record this side ended keeps its source blocks until the consumer
    # answered (it may still be reading them)
    await_peer: bool = False

    def drained(self) -> bool:
        return not self.ops and not self.await_peer


@dataclass
class Peer:
    """A producer that passed the handshake on the receiver's ROUTER."""

    ident: bytes  # its ZMQ identity on our ROUTER
    name: str  # its self-given name, for errors
    where: str  # its network address (for log lines)
    handle: object  # data-plane peer
    remote_blocks: int  # its pool size: source runs must lie inside it
    last_heard: float
    last_ping: float = 0.0
    last_tag: int = -1  # tags only move forward: a replayed PUSH is refused
    drains: list[object] = field(default_factory=list)  # receives of unwanted runs


@dataclass
class RecvRecord(Record[Peer]):
    dst: frozenset[int] = frozenset()  # the reserved blocks
    stop_to: Peer | None = None  # the producer to tell STOPPED once our reads drained
