"""The KV control channel's messages: one enum of kinds, a frozen dataclass per message, one
codec that checks every field before a handler sees it.

A frame is msgpack ``[kind, body]``; a turn's messages to one peer travel as one
``BATCH`` frame. Everything a peer sends is untrusted: ``decode`` raises ``MalformedMessage``
(naming the field) for anything but well-typed, in-range messages, and the I/O loop drops
and counts such frames instead of dying on them. Checks that need a side's state (block
ids inside a reservation, tags that only move forward) live with the handlers.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, replace
from typing import Any, ClassVar, NamedTuple

import msgpack

from transfer.types import TransferNotice

MAX_FRAME_BYTES = 4 << 20  # zmq.MAXMSGSIZE of every control socket; the sender stays under it
MAX_BATCH = 128  # messages in one BATCH frame
MAX_RUNS_PER_PUSH = 1024  # runs in one PUSH (about 25 KiB); longer pushes are split
MAX_ID_LEN = 256  # request ids and peer names
MAX_TEXT_LEN = 4096  # reasons and errors
MAX_PLANE_BYTES = 1 << 20  # data-plane info in a handshake (NIXL agent metadata is the largest)
MAX_LOGPROBS = 1024  # rows of token 0's logprobs (token 0 + its top-k)
U64 = 1 << 64
I64 = 1 << 63


class MalformedMessage(ValueError):
    """A peer's frame that is not a well-formed message of the protocol."""


class Kind(enum.StrEnum):
    """Every control message kind, producer -> consumer and back."""

    HELLO = "HELLO"  # producer: handshake (the first message of a connection)
    WELCOME = "WELCOME"  # consumer: handshake accepted
    REJECT = "REJECT"  # consumer: handshake refused, or a message before one
    PUSH = "PUSH"  # producer: runs on their way into reserved blocks
    FINISH = "FINISH"  # producer: the run count and token 0's notice (and when it left)
    CANCEL = "CANCEL"  # either side: stop this request
    ACK = "ACK"  # consumer: everything landed
    STOPPED = "STOPPED"  # consumer: nothing of ours reads the cancelled request's blocks now
    ERROR = "ERROR"  # consumer: refused a request's message
    PING = "PING"  # either side: liveness
    BATCH = "BATCH"  # a turn's messages as one frame (never nested)


class WireRun(NamedTuple):
    tag: int  # data-plane tag: (sender session << 32) | sequence number
    dst: int  # first destination block
    n: int  # blocks in the run, > 0
    src: int  # first source block (pull planes read from there)


@dataclass(frozen=True)
class Hello:
    """HELLO (producer) and WELCOME (consumer): both carry the same handshake."""

    KIND: ClassVar[Kind] = Kind.HELLO
    version: int
    backend: str
    layout: dict[str, Any]  # KVLayout fields; checked by transfer.handshake
    fingerprint: str
    plane: bytes  # opaque data-plane info (worker address, agent metadata, mapped pool)
    name: str
    token: str = ""  # producer only, and only without CURVE (which authenticates instead)

    def remote(self) -> dict[str, Any]:
        """The form ``transfer.handshake`` checks."""
        out = {"version": self.version, "backend": self.backend, "layout": self.layout,
               "fingerprint": self.fingerprint, "plane": self.plane}
        if self.token:
            out["token"] = self.token
        return out

    @property
    def num_blocks(self) -> int:
        return int(self.layout["num_blocks"])


@dataclass(frozen=True)
class Welcome(Hello):
    KIND: ClassVar[Kind] = Kind.WELCOME


@dataclass(frozen=True)
class Reject:
    KIND: ClassVar[Kind] = Kind.REJECT
    error: str


@dataclass(frozen=True)
class Push:
    KIND: ClassVar[Kind] = Kind.PUSH
    rid: str
    runs: tuple[WireRun, ...]


@dataclass(frozen=True)
class Finish:
    KIND: ClassVar[Kind] = Kind.FINISH
    rid: str
    total: int  # runs in the whole transfer
    notice: TransferNotice


@dataclass(frozen=True)
class Cancel:
    KIND: ClassVar[Kind] = Kind.CANCEL
    rid: str
    reason: str


@dataclass(frozen=True)
class Ack:
    KIND: ClassVar[Kind] = Kind.ACK
    rid: str


@dataclass(frozen=True)
class Stopped:
    KIND: ClassVar[Kind] = Kind.STOPPED
    rid: str


@dataclass(frozen=True)
class Error:
    KIND: ClassVar[Kind] = Kind.ERROR
    rid: str
    error: str


@dataclass(frozen=True)
class Ping:
    KIND: ClassVar[Kind] = Kind.PING


Message = Hello | Reject | Push | Finish | Cancel | Ack | Stopped | Error | Ping

# what each side accepts from its peer
TO_CONSUMER = frozenset({Kind.HELLO, Kind.PUSH, Kind.FINISH, Kind.CANCEL, Kind.PING})
TO_PRODUCER = frozenset({Kind.WELCOME, Kind.REJECT, Kind.ACK, Kind.STOPPED, Kind.CANCEL,
                         Kind.ERROR, Kind.PING})


# ---- encoding ----------------------------------------------------------------------
def body_of(m: Message) -> dict[str, Any]:
    if isinstance(m, Hello):
        out: dict[str, Any] = {"version": m.version, "backend": m.backend, "layout": m.layout,
                               "fingerprint": m.fingerprint, "plane": m.plane, "name": m.name}
        if m.token:
            out["token"] = m.token
        return out
    if isinstance(m, Push):
        return {"rid": m.rid, "runs": [list(r) for r in m.runs]}
    if isinstance(m, Finish):
        out = {"rid": m.rid, "total": m.total, "notice": m.notice.to_wire()}
        if m.notice.sent_ns:
            # a key beside the notice, not a 7th field in it: a consumer of before the
            # stamp checks the notice's length but ignores keys it does not know
            out["notice_sent_ns"] = m.notice.sent_ns
        return out
    if isinstance(m, Ping):
        return {}
    return dict(vars(m))  # Reject, Cancel, Ack, Stopped, Error: plain string fields


def encode(msgs: list[Message]) -> list[bytes]:
    """A turn's messages to one peer as few frames as the limits allow (usually one): a
    burst of pushes costs one send and one wake-up of the peer, not one each."""
    wire = [[m.KIND.value, body_of(m)] for m in _split_pushes(msgs)]
    if len(wire) == 1:
        return [_pack(wire[0])]
    return [_pack([Kind.BATCH.value, {"msgs": wire[i:i + MAX_BATCH]}])
            for i in range(0, len(wire), MAX_BATCH)]


def _split_pushes(msgs: list[Message]) -> list[Message]:
    out: list[Message] = []
    for m in msgs:
        if isinstance(m, Push) and len(m.runs) > MAX_RUNS_PER_PUSH:
            out += [Push(m.rid, m.runs[i:i + MAX_RUNS_PER_PUSH])
                    for i in range(0, len(m.runs), MAX_RUNS_PER_PUSH)]
        else:
            out.append(m)
    return out


def _pack(obj: Any) -> bytes:
    return bytes(msgpack.packb(obj, use_bin_type=True))


# ---- decoding ----------------------------------------------------------------------
def decode(data: bytes, accept: frozenset[Kind]) -> list[Message]:
    """Every message of one frame, or MalformedMessage naming what is wrong."""
    if len(data) > MAX_FRAME_BYTES:
        raise MalformedMessage(f"frame of {len(data)} bytes > {MAX_FRAME_BYTES}")
    try:
        obj = msgpack.unpackb(data, raw=False, strict_map_key=True)
    except Exception as e:  # msgpack raises several types (FormatError, ExtraData, ...)
        raise MalformedMessage(f"not msgpack: {type(e).__name__}: {e}") from None
    kind, body = _pair(obj, "frame")
    if kind == Kind.BATCH.value:
        msgs = _field(body, "msgs", list, "BATCH")
        if not 0 < len(msgs) <= MAX_BATCH:
            raise MalformedMessage(f"BATCH.msgs: {len(msgs)} messages, expected 1..{MAX_BATCH}")
        return [_one(*_pair(m, "BATCH.msgs[]"), accept) for m in msgs]
    return [_one(kind, body, accept)]


def decode_hello(data: bytes) -> Hello:
    """The first frame of a connection: one HELLO and nothing else."""
    msgs = decode(data, frozenset({Kind.HELLO}))
    if len(msgs) != 1 or not isinstance(msgs[0], Hello):
        raise MalformedMessage("the first frame of a connection must be one HELLO")
    return msgs[0]


def _pair(obj: Any, where: str) -> tuple[str, dict[str, Any]]:
    if not (isinstance(obj, list) and len(obj) == 2 and isinstance(obj[0], str)
            and isinstance(obj[1], dict)):
        raise MalformedMessage(f"{where}: expected [kind, {{body}}]")
    return obj[0], obj[1]


def _one(kind_s: str, b: dict[str, Any], accept: frozenset[Kind]) -> Message:
    try:
        kind = Kind(kind_s)
    except ValueError:
        raise MalformedMessage(f"unknown message kind {kind_s[:32]!r}") from None
    if kind not in accept:
        raise MalformedMessage(f"{kind.value}: not a message this side accepts")
    k = kind.value
    if kind in (Kind.HELLO, Kind.WELCOME):
        cls = Hello if kind == Kind.HELLO else Welcome
        layout = _field(b, "layout", dict, k)
        n = layout.get("num_blocks")
        if type(n) is not int or not 0 < n < I64:
            raise MalformedMessage(f"{k}.layout.num_blocks: expected an int > 0")
        plane = _field(b, "plane", bytes, k)
        if len(plane) > MAX_PLANE_BYTES:
            raise MalformedMessage(f"{k}.plane: {len(plane)} bytes > {MAX_PLANE_BYTES}")
        token = b.get("token", "")
        if not isinstance(token, str) or len(token) > MAX_TEXT_LEN:
            raise MalformedMessage(f"{k}.token: expected a string")
        return cls(_int(b, "version", k, 0, I64), _text(b, "backend", k, MAX_ID_LEN), layout,
                   _text(b, "fingerprint", k, MAX_ID_LEN), plane,
                   _text(b, "name", k, MAX_ID_LEN), token)
    if kind == Kind.PING:
        return Ping()
    if kind == Kind.REJECT:
        return Reject(_text(b, "error", k, MAX_TEXT_LEN))
    rid = _rid(b, k)
    if kind == Kind.PUSH:
        return Push(rid, _runs(b, k))
    if kind == Kind.FINISH:
        total, notice = _int(b, "total", k, 0, I64), _notice(b, rid, k)
        if "notice_sent_ns" in b:  # optional: a producer of before the stamp sends none
            notice = replace(notice, sent_ns=_int(b, "notice_sent_ns", k, 0, I64))
        return Finish(rid, total, notice)
    if kind == Kind.CANCEL:
        return Cancel(rid, _text(b, "reason", k, MAX_TEXT_LEN))
    if kind == Kind.ERROR:
        return Error(rid, _text(b, "error", k, MAX_TEXT_LEN))
    return Ack(rid) if kind == Kind.ACK else Stopped(rid)


def _field(b: dict[str, Any], name: str, typ: type, k: str) -> Any:
    v = b.get(name)
    if type(v) is not typ:  # exact: a bool is no int here
        raise MalformedMessage(f"{k}.{name}: expected {typ.__name__}, got {type(v).__name__}")
    return v


def _int(b: dict[str, Any], name: str, k: str, lo: int, hi: int) -> int:
    v = _field(b, name, int, k)
    if not lo <= v < hi:
        raise MalformedMessage(f"{k}.{name}: {v} outside [{lo}, {hi})")
    return int(v)


def _text(b: dict[str, Any], name: str, k: str, max_len: int) -> str:
    v = _field(b, name, str, k)
    if len(v) > max_len:
        raise MalformedMessage(f"{k}.{name}: longer than {max_len}")
    return str(v)


def _rid(b: dict[str, Any], k: str) -> str:
    rid = _text(b, "rid", k, MAX_ID_LEN)
    if not rid:
        raise MalformedMessage(f"{k}.rid: empty")
    return rid


def _runs(b: dict[str, Any], k: str) -> tuple[WireRun, ...]:
    runs = _field(b, "runs", list, k)
    if len(runs) > MAX_RUNS_PER_PUSH:
        raise MalformedMessage(f"{k}.runs: {len(runs)} runs > {MAX_RUNS_PER_PUSH}")
    out = []
    for r in runs:
        if not (type(r) is list and len(r) == 4 and all(type(x) is int for x in r)):
            raise MalformedMessage(f"{k}.runs[]: expected [tag, dst, n, src] ints")
        tag, dst, n, src = r
        if not (0 <= tag < U64 and 0 <= dst < I64 and 0 < n < I64 and 0 <= src < I64):
            raise MalformedMessage(f"{k}.runs[]: {r} out of range (tag u64, blocks >= 0, "
                                   "n > 0)")
        out.append(WireRun(tag, dst, n, src))
    return tuple(out)


def _notice(b: dict[str, Any], rid: str, k: str) -> TransferNotice:
    w = _field(b, "notice", list, k)
    if len(w) != 6:
        raise MalformedMessage(f"{k}.notice: expected 6 fields, got {len(w)}")
    nrid, tok, fin, nprompt, seed, lp = w
    if nrid != rid:
        raise MalformedMessage(f"{k}.notice.request_id: {str(nrid)[:64]!r} != rid {rid!r}")
    if type(tok) is not int or not 0 <= tok < 1 << 31:
        raise MalformedMessage(f"{k}.notice.first_token: expected an int in [0, 2**31)")
    if type(fin) is not bool:
        raise MalformedMessage(f"{k}.notice.finished: expected a bool")
    if type(nprompt) is not int or not 0 <= nprompt < I64:
        raise MalformedMessage(f"{k}.notice.num_prompt_tokens: expected an int >= 0")
    if seed is not None and (type(seed) is not int or not -I64 <= seed < U64):
        raise MalformedMessage(f"{k}.notice.seed: expected an int or nil")
    rows = None
    if lp is not None:
        if type(lp) is not list or not 0 < len(lp) <= MAX_LOGPROBS or not all(
                type(x) is list and len(x) == 2 and type(x[0]) is int and 0 <= x[0] < 1 << 31
                and type(x[1]) in (float, int) for x in lp):
            raise MalformedMessage(f"{k}.notice.logprobs: expected 1..{MAX_LOGPROBS} "
                                   "[token, logprob] rows")
        rows = tuple((int(t), float(p)) for t, p in lp)
    return TransferNotice(rid, tok, fin, nprompt, seed, rows)
