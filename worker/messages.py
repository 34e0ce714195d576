"""The typed messages between a worker's gRPC process and its engine process, and their codec.

Commands flow gRPC -> engine, events engine -> gRPC, through the checked codec of
``engine.codec``: one msgpack list ``[kind, *fields]`` per message, compact and cheap to
encode on the engine's hot path; a bad message is a ``MessageError`` naming the kind and
field, never an IndexError or KeyError deep in a handler.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from engine.codec import Codec
from engine.codec import MessageError as MessageError  # raised by decode
from engine.request import LogprobRow
from engine.sampling_params import SamplingParams
from worker.load_report import LoadReport

# ---- commands (gRPC process -> engine process) -------------------------------------------

@dataclass(frozen=True)
class PrefillCmd:
    KIND: ClassVar[str] = "prefill"
    rid: str
    prompt_ids: tuple[int, ...]
    sampling: SamplingParams  # checked by worker.convert at the gRPC door, and by the codec
    received_ns: int  # when the gRPC process received the request
    prior_ids: tuple[int, ...] = ()  # a migrated request's tokens already streamed
    cache_salt: str = ""  # only requests of one salt share cached prefix blocks
    dp_rank: int = -1  # attention data-parallel group to prefill it (-1: the least loaded)


@dataclass(frozen=True)
class DestinationCmd:
    KIND: ClassVar[str] = "dest"
    rid: str
    consumer_id: str
    kv_address: str
    block_ids: tuple[int, ...]
    cached_blocks: int = 0  # block_ids[:cached_blocks] hold the KV already: not sent


@dataclass(frozen=True)
class DecodeCmd:
    KIND: ClassVar[str] = "decode"
    rid: str
    prompt_ids: tuple[int, ...]
    sampling: SamplingParams
    colocated: bool
    prior_ids: tuple[int, ...] = ()  # a migrated request's tokens already streamed
    source_tp: int = 0  # consumer: the producer's TP size (0: unknown, taken as ours)
    cache_salt: str = ""
    reuse_cached: bool = False  # consumer: the reservation may take cached leading blocks
    dp_rank: int = -1  # attention data-parallel group to serve it (-1: the least loaded)


@dataclass(frozen=True)
class Token0SentCmd:
    """Token 0 is on its way to the router: the final transfer notice may now leave."""

    KIND: ClassVar[str] = "t0sent"
    rid: str


@dataclass(frozen=True)
class HoldCmd:
    """The router says the consumer is alive and its reservation waits for blocks: renew the
    lease on the prefilled blocks (producer)."""

    KIND: ClassVar[str] = "hold"
    rid: str
    consumer_id: str


@dataclass(frozen=True)
class AbortCmd:
    KIND: ClassVar[str] = "abort"
    rid: str


@dataclass(frozen=True)
class StopCmd:
    KIND: ClassVar[str] = "stop"


# ---- events (engine process -> gRPC process) ---------------------------------------------

@dataclass(frozen=True)
class ReadyInfo:
    """What an engine that is ready tells its gRPC process, which registers it with the
    router (RegisterRequest) and checks requests against it."""

    model: str
    kv_fingerprint: str  # the KV layout's identity (engine/kv_layout.py)
    max_model_len: int
    vocab_size: int = 0
    kv_blocks_total: int = 0
    kv_address: str = ""  # a consumer's KV receiver; "" for other roles
    tp_size: int = 1
    dp_size: int = 1  # attention data-parallel groups
    # prefix caching: what the router needs to compute the engine's block hash chains
    # (engine/prefix_hash.py; the model key is kv_fingerprint)
    block_size: int = 0
    prefix_caching: bool = False
    accepts_cache_salt: bool = False
    lease_s: float = 0.0  # a producer's KV lease, added by the gRPC process from its spec


@dataclass(frozen=True)
class ReadyEvent:
    KIND: ClassVar[str] = "ready"
    info: ReadyInfo


@dataclass(frozen=True)
class Token0Event:
    KIND: ClassVar[str] = "token0"
    rid: str
    token_id: int
    text: str
    logprob: LogprobRow | None
    finish: str | None  # None while the request goes on to the consumer
    stop_reason: str
    sampled_ns: int
    received_ns: int
    cached_tokens: int = 0  # prompt tokens the prefill found in the prefix cache


@dataclass(frozen=True)
class TransferResultEvent:
    KIND: ClassVar[str] = "transfer"
    rid: str
    ok: bool
    error: str
    kv_transfer_ms: float


@dataclass(frozen=True)
class ReservedEvent:
    KIND: ClassVar[str] = "reserved"
    rid: str
    kv_address: str
    block_ids: tuple[int, ...]
    cached_blocks: int = 0  # block_ids[:cached_blocks] came from the prefix cache


@dataclass(frozen=True)
class TokensEvent:
    KIND: ClassVar[str] = "tokens"
    rid: str
    ids: tuple[int, ...]
    text: str
    logprobs: tuple[LogprobRow, ...]
    finish: str | None
    stop_reason: str = ""
    error: str = ""
    kv_ready_ns: int = 0  # consumer: when the KV landed and the request was admitted
    first_step_ns: int = 0  # consumer: when its first decode step was launched
    cached_tokens: int = 0  # prompt tokens the request's prefill found cached


@dataclass(frozen=True)
class TokensBatchEvent:
    """One engine step's tokens for every request that got some: one message per step, so
    the cost of this hop does not grow with the batch (a step of 256 requests was 256
    messages)."""

    KIND: ClassVar[str] = "batch"
    items: tuple[TokensEvent, ...]


@dataclass(frozen=True)
class StatsEvent:
    KIND: ClassVar[str] = "stats"
    load: LoadReport


@dataclass(frozen=True)
class KVBlocksEvent:
    """One prefix-cache event (engine/prefix_cache.py BlocksStored / BlocksRemoved)."""

    KIND: ClassVar[str] = "kvblocks"
    seq: int
    removed: bool  # False: stored
    hashes: tuple[bytes, ...]


@dataclass(frozen=True)
class KVEventsEvent:
    """A step's prefix-cache events, in seq order (one message per step that had any)."""

    KIND: ClassVar[str] = "kv"
    items: tuple[KVBlocksEvent, ...]


@dataclass(frozen=True)
class KVSnapshotEvent:
    """Every cached block as of event ``seq``: sent instead of events after a gap (the
    engine's bounded queue dropped some)."""

    KIND: ClassVar[str] = "kvsnap"
    seq: int
    hashes: tuple[bytes, ...]


@dataclass(frozen=True)
class FatalEvent:
    KIND: ClassVar[str] = "fatal"
    error: str


Command = (PrefillCmd | DestinationCmd | DecodeCmd | Token0SentCmd | HoldCmd | AbortCmd
           | StopCmd)
Event = (ReadyEvent | Token0Event | TransferResultEvent | ReservedEvent | TokensEvent
         | TokensBatchEvent | StatsEvent | KVBlocksEvent | KVEventsEvent | KVSnapshotEvent
         | FatalEvent)
Message = Command | Event

COMMANDS: tuple[type[Command], ...] = (PrefillCmd, DestinationCmd, DecodeCmd, Token0SentCmd,
                                       HoldCmd, AbortCmd, StopCmd)
EVENTS: tuple[type[Event], ...] = (ReadyEvent, Token0Event, TransferResultEvent, ReservedEvent,
                                   TokensEvent, TokensBatchEvent, StatsEvent, KVBlocksEvent,
                                   KVEventsEvent, KVSnapshotEvent, FatalEvent)


# ---- the codec ---------------------------------------------------------------------------

_CODEC = Codec((*COMMANDS, *EVENTS))


def encode(msg: Message) -> bytes:
    return _CODEC.encode(msg)


def decode(data: bytes) -> Message:
    msg: Message = _CODEC.decode(data)
    return msg


def rid_of(msg: Message) -> str:
    """The request a message belongs to; '' for worker-wide ones (stats, ready, fatal, stop)."""
    return getattr(msg, "rid", "")
