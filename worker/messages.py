"""The typed messages between a worker's gRPC process and its engine process, and their codec.

Commands flow gRPC -> engine, events engine -> gRPC. On the wire each message is one msgpack
list ``[kind, *fields]`` in field order: compact and cheap to encode on the engine's hot path.
``decode`` checks the kind, the field count and every field's type, so a bad message is a
``MessageError`` naming the kind and field, never an IndexError or KeyError deep in a handler.
"""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

import msgpack

from engine.request import LogprobRow


class MessageError(ValueError):
    """A message that is not one of ours: unknown kind, missing field, wrong type, bad bytes."""


# ---- commands (gRPC process -> engine process) -------------------------------------------

@dataclass(frozen=True)
class PrefillCmd:
    KIND: ClassVar[str] = "prefill"
    rid: str
    prompt_ids: tuple[int, ...]
    sampling: dict[str, Any]  # SamplingParams.from_dict input, built by worker.convert
    received_ns: int  # when the gRPC process received the request
    prior_ids: tuple[int, ...] = ()  # a migrated request's tokens already streamed
    cache_salt: str = ""  # only requests of one salt share cached prefix blocks


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
    sampling: dict[str, Any]
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
class ReadyEvent:
    KIND: ClassVar[str] = "ready"
    info: dict[str, Any]  # kv_address, kv_fingerprint, model, max_model_len, kv_blocks_total


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
    load: dict[str, Any]


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

def _row_out(r: LogprobRow) -> list[Any]:
    return [r.token_id, r.logprob, [[t, p] for t, p in r.top]]


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_float(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _row_in(v: Any) -> LogprobRow:
    if not (isinstance(v, (list, tuple)) and len(v) == 3 and _is_int(v[0])
            and _is_float(v[1]) and isinstance(v[2], (list, tuple))):
        raise TypeError("a logprob row [token_id, logprob, [[token_id, logprob], ...]]")
    top = []
    for pair in v[2]:
        if not (isinstance(pair, (list, tuple)) and len(pair) == 2 and _is_int(pair[0])
                and _is_float(pair[1])):
            raise TypeError("a logprob row's top entries are [token_id, logprob] pairs")
        top.append((pair[0], float(pair[1])))
    return LogprobRow(v[0], float(v[1]), tuple(top))


def _ints(v: Any) -> tuple[int, ...]:
    if not isinstance(v, (list, tuple)) or not all(_is_int(x) for x in v):
        raise TypeError("a list of integers")
    return tuple(v)


def _scalar(kind: type, name: str) -> Callable[[Any], Any]:
    def check(v: Any) -> Any:
        ok = {int: _is_int, float: _is_float}.get(kind, lambda x: isinstance(x, kind))(v)
        if not ok:
            raise TypeError(f"{name}")
        return float(v) if kind is float else v
    return check


def _bytes_list(v: Any) -> tuple[bytes, ...]:
    if not isinstance(v, (list, tuple)) or not all(isinstance(x, bytes) for x in v):
        raise TypeError("a list of byte strings")
    return tuple(v)


def _str_dict(v: Any) -> dict[str, Any]:
    if not isinstance(v, dict) or not all(isinstance(k, str) for k in v):
        raise TypeError("a map with string keys")
    return v


def _optional(inner: Callable[[Any], Any]) -> Callable[[Any], Any]:
    return lambda v: None if v is None else inner(v)


def _rows(v: Any) -> tuple[LogprobRow, ...]:
    if not isinstance(v, (list, tuple)):
        raise TypeError("a list of logprob rows")
    return tuple(_row_in(x) for x in v)


# Per annotation: (to the wire, from the wire with checks). Every field type used above.
_CODECS: dict[Any, tuple[Callable[[Any], Any], Callable[[Any], Any]]] = {
    str: (lambda v: v, _scalar(str, "a string")),
    int: (lambda v: v, _scalar(int, "an integer")),
    float: (lambda v: v, _scalar(float, "a number")),
    bool: (lambda v: v, _scalar(bool, "a boolean")),
    str | None: (lambda v: v, _optional(_scalar(str, "a string or nil"))),
    tuple[int, ...]: (list, _ints),
    tuple[bytes, ...]: (list, _bytes_list),
    dict[str, Any]: (lambda v: v, _str_dict),
    LogprobRow | None: (lambda v: None if v is None else _row_out(v), _optional(_row_in)),
    tuple[LogprobRow, ...]: (lambda v: [_row_out(r) for r in v], _rows),
}


@dataclass(frozen=True)
class _Shape:
    cls: type
    names: tuple[str, ...]
    required: int  # fields without a default
    out: tuple[Callable[[Any], Any], ...]
    inn: tuple[Callable[[Any], Any], ...]


def _shape(cls: type) -> _Shape:
    hints = typing.get_type_hints(cls)
    fields = dataclasses.fields(cls)
    codecs = [_CODECS[hints[f.name]] for f in fields]
    required = sum(1 for f in fields if f.default is dataclasses.MISSING)
    return _Shape(cls, tuple(f.name for f in fields), required,
                  tuple(c[0] for c in codecs), tuple(c[1] for c in codecs))


def _nested(cls: type) -> tuple[Callable[[Any], Any], Callable[[Any], Any]]:
    """A tuple of ``cls`` messages as a list of their field lists, each checked like a
    message of its own (errors name the item's field)."""
    shape = _shape(cls)

    def out(items: Any) -> list[Any]:
        return [[conv(getattr(m, n)) for n, conv in zip(shape.names, shape.out, strict=True)]
                for m in items]

    def inn(v: Any) -> tuple[Any, ...]:
        if not isinstance(v, (list, tuple)):
            raise TypeError("a list of messages")
        # "[i]" here; the enclosing field prefixes "kind.field" (see _build)
        return tuple(_build(shape, item, f"[{i}]") for i, item in enumerate(v))
    return out, inn


_CODECS[tuple[TokensEvent, ...]] = _nested(TokensEvent)
_CODECS[tuple[KVBlocksEvent, ...]] = _nested(KVBlocksEvent)
_BY_KIND: dict[str, _Shape] = {c.KIND: _shape(c) for c in (*COMMANDS, *EVENTS)}
_BY_CLASS: dict[type, _Shape] = {s.cls: s for s in _BY_KIND.values()}


def encode(msg: Message) -> bytes:
    shape = _BY_CLASS[type(msg)]
    body = [conv(getattr(msg, n)) for n, conv in zip(shape.names, shape.out, strict=True)]
    out: bytes = msgpack.packb([msg.KIND, *body], use_bin_type=True)
    return out


def decode(data: bytes) -> Message:
    try:
        raw = msgpack.unpackb(data, raw=False)
    except Exception as e:  # msgpack raises several unrelated types for bad bytes
        raise MessageError(f"message: not a valid msgpack message ({type(e).__name__}: "
                           f"{e})") from None
    if not isinstance(raw, list) or not raw or not isinstance(raw[0], str):
        raise MessageError("message: expected a list [kind, *fields]")
    kind, values = raw[0], raw[1:]
    shape = _BY_KIND.get(kind)
    if shape is None:
        raise MessageError(f"kind: unknown message kind {kind!r}")
    msg: Message = _build(shape, values, kind)
    return msg


def _build(shape: _Shape, values: Any, kind: str) -> Any:
    """One message of ``shape`` from its field list, every field checked. ``kind`` leads
    every error: the message's kind, or "[i]" for an item nested in a field."""
    if not isinstance(values, (list, tuple)):
        raise MessageError(f"{kind}: expected a list of fields")
    if not shape.required <= len(values) <= len(shape.names):
        missing = shape.names[len(values)] if len(values) < shape.required else None
        raise MessageError(f"{kind}.{missing}: missing field" if missing else
                           f"{kind}: {len(values)} fields, expected at most "
                           f"{len(shape.names)}")
    args = {}
    for name, check, v in zip(shape.names, shape.inn, values, strict=False):
        try:
            args[name] = check(v)
        except TypeError as e:
            raise MessageError(f"{kind}.{name}: expected {e}, got {type(v).__name__}") \
                from None
        except MessageError as e:  # a nested message's own field
            raise MessageError(f"{kind}.{name}{e}") from None
    return shape.cls(**args)


def rid_of(msg: Message) -> str:
    """The request a message belongs to; '' for worker-wide ones (stats, ready, fatal, stop)."""
    return getattr(msg, "rid", "")
