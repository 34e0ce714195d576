"""The typed messages between a worker's gRPC process and its engine process, and their codec.

Commands flow gRPC -> engine, events engine -> gRPC, through the checked codec of
``engine.codec``: one msgpack list ``[kind, *fields]`` per message, compact and cheap to
encode on the engine's hot path; a bad message is a ``MessageError`` naming the kind and
field, never an IndexError or KeyError deep in a handler. A step's token events (per request,
and the columnar per-step batch the engine sends) are defined in ``worker.token_batch``.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

from engine.codec import BASE, Codec
from engine.codec import MessageError as MessageError  # raised by decode
from engine.request import LogprobRow
from engine.sampling_params import SamplingParams
from worker.load_report import HeldRow, LoadReport
from worker.token_batch import TokensBatchEvent, TokensEvent

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
    # when the engine process emitted it, after the step's read-back (Unix ns): splits the
    # producer's half of the first-token hold into the engine's part and the hop after it
    emitted_ns: int = 0


@dataclass(frozen=True)
class TransferResultEvent:
    KIND: ClassVar[str] = "transfer"
    rid: str
    ok: bool
    error: str
    kv_transfer_ms: float
    busy: bool = False  # refused before its prefill: the engine's waiting queue is full


@dataclass(frozen=True)
class ReservedEvent:
    KIND: ClassVar[str] = "reserved"
    rid: str
    kv_address: str
    block_ids: tuple[int, ...]
    cached_blocks: int = 0  # block_ids[:cached_blocks] came from the prefix cache


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

_F64 = np.dtype("<f8")


def _floats_out(v: list[float]) -> bytes:
    return np.asarray(v, dtype=_F64).tobytes()


def _floats_in(v: Any) -> list[float]:
    if v == b"":
        return []
    if not isinstance(v, bytes) or len(v) % 8:
        raise TypeError("packed float64 bytes")
    out: list[float] = np.frombuffer(v, dtype=_F64).tolist()
    return out


_STR = frozenset({str})


def _strs_in(v: Any) -> list[str]:
    # a step's request ids and texts: one C-level pass over the column's types, not a
    # Python-level check per entry (that was most of the step message's decode time)
    if not isinstance(v, list) or not set(map(type, v)) <= _STR:
        raise TypeError("a list of strings")
    return v


def _ints_in(v: Any) -> list[int]:
    return [] if v == b"" else _packed_ints_in(v)  # most sparse columns of a step are empty


_packed_ints_out, _packed_ints_in = BASE[list[int]]


_HELD_COLUMNS = ("request_id", "state", "age_s", "state_age_s", "blocks")


def _held_out(rows: tuple[HeldRow, ...]) -> list[Any]:
    return [[r.request_id for r in rows], [r.state for r in rows],
            _floats_out([r.age_s for r in rows]), _floats_out([r.state_age_s for r in rows]),
            _packed_ints_out([r.blocks for r in rows])]


def _held_in(v: Any) -> tuple[HeldRow, ...]:
    # A load report lists up to 500 held requests, 4 times a second: as columns, not one
    # checked record each (that was ~10 µs per row in the gRPC process).
    if not (isinstance(v, list) and len(v) == 5):
        raise TypeError("the held requests as 5 columns [ids, states, ages, state ages, "
                        "blocks]")
    cols: list[Any] = []
    for name, conv, col in zip(_HELD_COLUMNS, (_strs_in, _strs_in, _floats_in, _floats_in,
                                               _ints_in), v, strict=True):
        try:
            cols.append(conv(col))
        except TypeError as e:
            raise TypeError(f"its {name} column as {e}") from None
    ids, states, ages, state_ages, blocks = cols
    if not len(ids) == len(states) == len(ages) == len(state_ages) == len(blocks):
        raise TypeError("held request columns of one length")
    return tuple(map(HeldRow, ids, states, ages, state_ages, blocks))

_BYTES = frozenset({bytes})


def _hashes_in(v: Any) -> tuple[bytes, ...]:
    if not isinstance(v, list) or not set(map(type, v)) <= _BYTES:
        raise TypeError("a list of bytes")
    return tuple(v)


def _kv_items_out(items: tuple[KVBlocksEvent, ...]) -> list[Any]:
    return [_packed_ints_out([e.seq for e in items]),
            _packed_ints_out([int(e.removed) for e in items]),
            _packed_ints_out([len(e.hashes) for e in items]),
            [h for e in items for h in e.hashes]]


def _kv_items_in(v: Any) -> tuple[KVBlocksEvent, ...]:
    # A step's prefix-cache events (blocks stored and evicted) as columns: seqs, removed
    # flags, hashes per event, every hash
    if not (isinstance(v, list) and len(v) == 4):
        raise TypeError("the events as 4 columns [seqs, removed, counts, hashes]")
    try:
        seqs, removed, counts = _ints_in(v[0]), _ints_in(v[1]), _ints_in(v[2])
        hashes = _hashes_in(v[3])
    except TypeError as e:
        raise TypeError(f"the events as columns [seqs, removed, counts, hashes] ({e})") \
            from None
    if not len(seqs) == len(removed) == len(counts) or sum(counts) != len(hashes) \
            or (counts and min(counts) < 0) or not set(removed) <= {0, 1}:
        raise TypeError("event columns that agree (one length; counts adding up to the "
                        "hashes; removed 0 or 1)")
    starts = itertools.accumulate(counts, initial=0)
    return tuple(KVBlocksEvent(q, bool(r), hashes[o:o + n])
                 for q, r, n, o in zip(seqs, removed, counts, starts, strict=False))


# list[float] (a step's logprobs) travels packed like list[int]: one numpy call, lossless
_CODEC = Codec((*COMMANDS, *EVENTS), extra={list[float]: (_floats_out, _floats_in),
                                            list[str]: (list, _strs_in),
                                            list[int]: (_packed_ints_out, _ints_in),
                                            tuple[HeldRow, ...]: (_held_out, _held_in),
                                            tuple[bytes, ...]: (list, _hashes_in),
                                            tuple[KVBlocksEvent, ...]: (_kv_items_out,
                                                                        _kv_items_in)})


def encode(msg: Message) -> bytes:
    return _CODEC.encode(msg)


def decode(data: bytes) -> Message:
    msg: Message = _CODEC.decode(data)
    return msg


def rid_of(msg: Message) -> str:
    """The request a message belongs to; '' for worker-wide ones (stats, ready, fatal, stop)."""
    return getattr(msg, "rid", "")
