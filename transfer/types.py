"""Small value types shared by every transfer backend: status, notice, update, config, errors."""

from __future__ import annotations

import enum
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from typing import Any

# Bumped whenever a control message changes shape; peers with another version refuse.
PROTOCOL_VERSION = 3  # 2: PUSH runs carry their source block; STOPPED. 3: TP split in layouts
BACKENDS = ("ucx", "nixl", "ipc", "fake")


class TransferStatus(enum.IntEnum):
    PENDING = 0  # known (expected / first push queued), no byte moved yet
    IN_FLIGHT = 1  # bytes moving; also while a cancel drains operations already posted
    DONE = 2  # all bytes + notice landed and the consumer acknowledged
    CANCELLED = 3  # cancelled by either side
    FAILED = 4  # protocol error, data-plane error or dead/silent peer
    TIMED_OUT = 5  # the transfer's deadline passed

    @property
    def terminal(self) -> bool:
        """Terminal means no byte of this transfer will be read or written again."""
        return self >= TransferStatus.DONE


class TransferError(RuntimeError):
    """A transfer-level failure the caller made (bad ids, unknown peer) or a backend fault."""


class HandshakeError(TransferError):
    """Peers cannot talk: protocol version, backend or KV layout differ."""


@dataclass(frozen=True)
class TransferNotice:
    """What the producer hands the consumer with the last push: enough to continue decoding."""

    request_id: str
    first_token: int  # token 0, sampled at the end of prefill
    finished: bool  # token 0 already ended the request (EOS, stop, max_tokens == 1)
    num_prompt_tokens: int  # KV positions the pushed blocks hold
    seed: int | None = None  # per-request sampling seed (randomness is f(seed, position))
    logprobs: tuple[tuple[int, float], ...] | None = None  # token 0 first, then top-k alternatives
    # When the producer handed this notice to its sender, re-stamped by a network sender
    # as the FINISH goes on the wire (Unix ns, 0: unknown), for the handoff's timing. Not
    # content: producer ranks agree on token 0, not on the moment each let it go, so it
    # takes no part in comparing notices. On the wire it travels beside the notice
    # (``transfer.wire``: FINISH's optional ``notice_sent_ns``).
    sent_ns: int = field(default=0, compare=False)

    def sent_last(self, notices: Iterable[TransferNotice | None]) -> TransferNotice:
        """This notice stamped with the latest ``sent_ns`` among ``notices`` (the same
        notice from several producer ranks: the KV is whole only once the last one left)."""
        return replace(self, sent_ns=max((n.sent_ns for n in notices if n is not None),
                                         default=self.sent_ns))

    def to_wire(self) -> list[Any]:
        """The notice's content (``sent_ns`` is a stamp: FINISH carries it beside)."""
        lp = None if self.logprobs is None else [list(x) for x in self.logprobs]
        return [self.request_id, self.first_token, self.finished, self.num_prompt_tokens,
                self.seed, lp]

    @classmethod
    def from_wire(cls, w: list[Any]) -> TransferNotice:
        lp = None if w[5] is None else tuple((int(t), float(p)) for t, p in w[5])
        return cls(str(w[0]), int(w[1]), bool(w[2]), int(w[3]), w[4], lp)


@dataclass(frozen=True)
class TransferUpdate:
    """One terminal outcome, returned once by ``poll()``."""

    request_id: str
    status: TransferStatus
    notice: TransferNotice | None = None  # receiver side, DONE only
    error: str | None = None  # what failed / why cancelled; None when DONE
    # Receiver side, DONE only (Unix ns, 0: unknown), for the handoff's timing: when the
    # receiver read the notice (the last of them when several producer ranks sent one),
    # and when it knew every run had landed, i.e. when this update became pollable.
    notice_seen_ns: int = 0
    kv_done_ns: int = 0


@dataclass(frozen=True)
class Accounting:
    """A side's own books; all zero after every transfer was released and peers closed."""

    transfers: int  # records not yet released
    ops_in_flight: int  # data-plane operations posted and not yet completed
    peers: int  # live connections


@dataclass(frozen=True)
class TransferStats:
    """Counters of a side's control channel, for the worker's /metrics."""

    malformed_messages: int = 0  # peer frames dropped: undecodable, ill-typed, out of range
    rejected_handshakes: int = 0  # HELLOs refused (token, version, backend, layout)
    # KV bytes this side posted: sent (sender) or taken into reserved blocks (receiver);
    # with a TP split only the heads each consumer rank takes from this rank count
    payload_bytes: int = 0


@dataclass(frozen=True)
class TransferConfig:
    backend: str = "ucx"  # "ucx" | "nixl" | "fake"
    host: str = "127.0.0.1"  # the receiver's control socket binds (and advertises) this host
    port: int = 0  # 0: an ephemeral port, read back from receiver.address
    transfer_timeout_s: float = 30.0  # deadline of a transfer that was given none
    heartbeat_interval_s: float = 1.0  # pings to every peer this often
    peer_timeout_s: float = 5.0  # a peer heard nothing from for this long is dead
    connect_timeout_s: float = 5.0  # handshake wait in connect()
    ucx_progress: str = "thread"  # "thread" (epoll wakeups) | "thread-polling" (spins a core)
    # Shared secret a sender presents in its handshake; a receiver with one set refuses
    # senders without it, so a stray process cannot write into reserved KV blocks.
    cluster_token: str = field(default="", repr=False)
    # With a token: encrypt and authenticate the control channel with ZMQ CURVE (keys
    # derived from the token), so the token never crosses the network in clear.
    curve: bool = True

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise ValueError(f"backend: expected one of {BACKENDS}, got {self.backend!r}")
        if not 0 <= self.port < 65536:
            raise ValueError(f"port: out of range: {self.port}")
        for name in ("transfer_timeout_s", "heartbeat_interval_s", "peer_timeout_s",
                     "connect_timeout_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name}: must be > 0, got {getattr(self, name)}")
        if self.peer_timeout_s > 10.0:
            raise ValueError(f"peer_timeout_s: must be <= 10 s, got {self.peer_timeout_s}")
        if self.heartbeat_interval_s * 2 > self.peer_timeout_s:
            # two missed pings must fit in the timeout, or a live peer is declared dead
            raise ValueError("heartbeat_interval_s: must be <= peer_timeout_s / 2")
        if self.ucx_progress not in ("thread", "thread-polling"):
            raise ValueError(f"ucx_progress: expected 'thread' or 'thread-polling', "
                             f"got {self.ucx_progress!r}")
