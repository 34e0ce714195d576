"""The typed messages between a worker's gRPC process and its engine process, and their codec.

Commands flow gRPC -> engine, events engine -> gRPC, through the checked codec of
``engine.codec``: one msgpack list ``[kind, *fields]`` per message, compact and cheap to
encode on the engine's hot path; a bad message is a ``MessageError`` naming the kind and
field, never an IndexError or KeyError deep in a handler.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np

from engine.codec import BASE, Codec
from engine.codec import MessageError as MessageError  # raised by decode
from engine.request import LogprobRow
from engine.sampling_params import SamplingParams
from worker.load_report import HeldRow, LoadReport

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
    """One engine step's tokens for every request that got some, as parallel columns: one
    message per step, so the cost of this hop does not grow with the batch, and decoding it
    checks each column once (a packed column is one numpy call) instead of a record per
    request. The engine process fills one with ``TokensBatchBuilder``; ``events`` gives the
    requests' ``TokensEvent``s back.

    Request ``i`` is ``rids[i]``; its tokens are the next ``counts[i]`` of ``ids`` and its
    text ``texts[i]``. The fields most steps do not have travel sparse, by index into
    ``rids``: ``ended`` (finish reason, stop reason, error: the request's last message),
    ``timed`` (a consumer's first-message timestamps and the prompt's cached tokens). With
    logprobs (any request of the step asked), ``lp_counts[i]`` rows belong to request ``i``;
    row ``r`` is token ``lp_ids[r]`` at ``lp_values[r]`` with ``top_counts[r]`` alternatives
    from ``top_ids`` / ``top_values``.
    """

    KIND: ClassVar[str] = "batch"
    rids: list[str]
    counts: list[int]
    ids: list[int]
    texts: list[str]
    ended: list[int] = field(default_factory=list)
    finishes: list[str] = field(default_factory=list)
    stop_reasons: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    timed: list[int] = field(default_factory=list)
    kv_ready_ns: list[int] = field(default_factory=list)
    first_step_ns: list[int] = field(default_factory=list)
    cached_tokens: list[int] = field(default_factory=list)
    lp_counts: list[int] = field(default_factory=list)
    lp_ids: list[int] = field(default_factory=list)
    lp_values: list[float] = field(default_factory=list)
    top_counts: list[int] = field(default_factory=list)
    top_ids: list[int] = field(default_factory=list)
    top_values: list[float] = field(default_factory=list)

    def __post_init__(self) -> None:
        # The codec reports a ValueError("field: why") as "batch.field: why". Each column
        # is checked as a whole (lengths, ranges: C-level calls); the sparse groups only
        # when the step has them.
        n = len(self.rids)
        _same_len(n, ("counts", self.counts), ("texts", self.texts))
        _counts("counts", self.counts, "ids", self.ids)
        _token_ids("ids", self.ids)
        if self.ended or self.finishes or self.stop_reasons or self.errors:
            _indices("ended", self.ended, n)
            _same_len(len(self.ended), ("finishes", self.finishes),
                      ("stop_reasons", self.stop_reasons), ("errors", self.errors))
            if not set(self.finishes) <= FINISHES:
                raise ValueError(f"finishes: each one of {sorted(FINISHES)}")
        if self.timed or self.kv_ready_ns or self.first_step_ns or self.cached_tokens:
            _indices("timed", self.timed, n)
            _same_len(len(self.timed), ("kv_ready_ns", self.kv_ready_ns),
                      ("first_step_ns", self.first_step_ns),
                      ("cached_tokens", self.cached_tokens))
        if self.lp_counts or self.lp_ids or self.lp_values or self.top_counts \
                or self.top_ids or self.top_values:
            _same_len(n, ("lp_counts", self.lp_counts))
            _counts("lp_counts", self.lp_counts, "lp_ids", self.lp_ids)
            _token_ids("lp_ids", self.lp_ids)
            _same_len(len(self.lp_ids), ("lp_values", self.lp_values),
                      ("top_counts", self.top_counts))
            _counts("top_counts", self.top_counts, "top_ids", self.top_ids)
            _token_ids("top_ids", self.top_ids)
            _same_len(len(self.top_ids), ("top_values", self.top_values))

    @classmethod
    def of(cls, events: Sequence[TokensEvent]) -> TokensBatchEvent:
        """The columns of per-request events."""
        b = TokensBatchBuilder()
        for ev in events:
            b.add(ev.rid, ev.ids, ev.text, ev.logprobs, ev.finish, ev.stop_reason, ev.error,
                  ev.kv_ready_ns, ev.first_step_ns, ev.cached_tokens)
        return b.build()

    def logprob_rows(self) -> list[tuple[LogprobRow, ...]]:
        """Each request's logprob rows (empty tuples when the step carries none)."""
        if not self.lp_counts:
            return [()] * len(self.rids)
        rows: list[LogprobRow] = []
        t = 0
        for tok, val, k in zip(self.lp_ids, self.lp_values, self.top_counts, strict=True):
            rows.append(LogprobRow(tok, val, tuple(zip(self.top_ids[t:t + k],
                                                       self.top_values[t:t + k],
                                                       strict=True))))
            t += k
        out = []
        r = 0
        for k in self.lp_counts:
            out.append(tuple(rows[r:r + k]))
            r += k
        return out

    def events(self, only: Iterable[int] | None = None) -> tuple[TokensEvent, ...]:
        """The step as one ``TokensEvent`` per request, in order (only: those indices)."""
        ends = {i: (f or None, s, e) for i, f, s, e in zip(
            self.ended, self.finishes, self.stop_reasons, self.errors, strict=True)}
        times = {i: (k, f, c) for i, k, f, c in zip(
            self.timed, self.kv_ready_ns, self.first_step_ns, self.cached_tokens, strict=True)}
        rows = self.logprob_rows()
        starts = [0, *itertools.accumulate(self.counts)]
        out = []
        for i in range(len(self.rids)) if only is None else only:
            n, o = self.counts[i], starts[i]
            finish, stop, error = ends.get(i, (None, "", ""))
            kv, first, cached = times.get(i, (0, 0, 0))
            out.append(TokensEvent(self.rids[i], tuple(self.ids[o:o + n]), self.texts[i],
                                   rows[i], finish, stop, error, kv, first, cached))
        return tuple(out)


class TokensBatchBuilder:
    """Collects a step's requests straight into the columns of a ``TokensBatchEvent`` (the
    engine process's side: no per-request event object on the way)."""

    def __init__(self) -> None:
        self.rids: list[str] = []
        self.counts: list[int] = []
        self.ids: list[int] = []
        self.texts: list[str] = []
        self.ended: list[int] = []
        self.finishes: list[str] = []
        self.stop_reasons: list[str] = []
        self.errors: list[str] = []
        self.timed: list[int] = []
        self.kv_ready_ns: list[int] = []
        self.first_step_ns: list[int] = []
        self.cached_tokens: list[int] = []
        self.lp_counts: list[int] = []  # filled from the first request with logprobs on
        self.lp_ids: list[int] = []
        self.lp_values: list[float] = []
        self.top_counts: list[int] = []
        self.top_ids: list[int] = []
        self.top_values: list[float] = []

    def __len__(self) -> int:
        return len(self.rids)

    def add(self, rid: str, ids: Sequence[int], text: str,
            logprobs: Sequence[LogprobRow] = (), finish: str | None = None,
            stop_reason: str = "", error: str = "", kv_ready_ns: int = 0,
            first_step_ns: int = 0, cached_tokens: int = 0) -> None:
        i = len(self.rids)
        self.rids.append(rid)
        self.counts.append(len(ids))
        self.ids.extend(ids)
        self.texts.append(text)
        if finish or stop_reason or error:
            self.ended.append(i)
            self.finishes.append(finish or "")
            self.stop_reasons.append(stop_reason)
            self.errors.append(error)
        if kv_ready_ns or first_step_ns or cached_tokens:
            self.timed.append(i)
            self.kv_ready_ns.append(kv_ready_ns)
            self.first_step_ns.append(first_step_ns)
            self.cached_tokens.append(cached_tokens)
        if logprobs and not self.lp_counts:
            self.lp_counts = [0] * i  # the requests before this one had none
        if self.lp_counts or logprobs:
            self.lp_counts.append(len(logprobs))
            for row in logprobs:
                self.lp_ids.append(row.token_id)
                self.lp_values.append(row.logprob)
                self.top_counts.append(len(row.top))
                for t, v in row.top:
                    self.top_ids.append(t)
                    self.top_values.append(v)

    def build(self) -> TokensBatchEvent:
        return TokensBatchEvent(
            self.rids, self.counts, self.ids, self.texts, self.ended, self.finishes,
            self.stop_reasons, self.errors, self.timed, self.kv_ready_ns, self.first_step_ns,
            self.cached_tokens, self.lp_counts, self.lp_ids, self.lp_values, self.top_counts,
            self.top_ids, self.top_values)


FINISHES = frozenset({"", "stop", "length", "abort", "error"})  # "": not finished
_TOKEN_ID_LIMIT = 2**32  # the wire's token ids are uint32


def _same_len(n: int, *named: tuple[str, Sequence[Any]]) -> None:
    for name, col in named:
        if len(col) != n:
            raise ValueError(f"{name}: {len(col)} entries, expected {n}")


def _counts(name: str, counts: list[int], of: str, items: list[Any]) -> None:
    """counts[i] of ``items`` belong to entry i: none negative, all of them accounted for."""
    if counts and min(counts) < 0:
        raise ValueError(f"{name}: a negative count")
    if sum(counts) != len(items):
        raise ValueError(f"{of}: {len(items)} entries, {name} add up to {sum(counts)}")


def _indices(name: str, col: list[int], n: int) -> None:
    if col and (min(col) < 0 or max(col) >= n):
        raise ValueError(f"{name}: an index outside the batch's {n} requests")
    if any(a >= b for a, b in zip(col, col[1:], strict=False)):
        raise ValueError(f"{name}: indices must be increasing")


def _token_ids(name: str, col: list[int]) -> None:
    if col and (min(col) < 0 or max(col) >= _TOKEN_ID_LIMIT):
        raise ValueError(f"{name}: a token id outside [0, 2**32)")


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
