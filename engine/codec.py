"""The one checked codec for messages between processes: frozen dataclasses, each with a
``KIND`` class attribute, as msgpack lists ``[kind, *fields]`` in field order.

Every channel (the worker's gRPC <-> engine IPC, the tensor-parallel rank channel, a rank
side's transfer messages) builds a ``Codec`` over its own message classes. ``decode``
checks the kind, the field count and every field's type against the class's annotations,
so a bad message is a ``MessageError`` naming the kind and field (``"push.dst: expected a
list of integers, got str"``), never an IndexError deep in a handler; no pickle, so a
peer's bytes can never run code.

How a field travels follows from its annotation: scalars and ``X | None`` as themselves,
``tuple[X, ...]`` as a list, a fixed ``tuple[X, Y]`` as a list of that length, an
``IntEnum`` as its value, a nested dataclass as its field list. Two annotations travel
packed, for the per-step plans of a tensor-parallel engine: ``list[int]`` (a prefill chunk
of thousands of tokens) as little-endian int64 bytes, and ``np.ndarray`` as
``[dtype, shape, bytes]``; unpacking them is one numpy call, not a check per element.
"""

from __future__ import annotations

import dataclasses
import enum
import types
import typing
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import msgpack
import numpy as np

from engine.request import LogprobRow


class MessageError(ValueError):
    """A message that is not one of ours: unknown kind, missing field, wrong type, bad bytes."""


Conv = tuple[Callable[[Any], Any], Callable[[Any], Any]]  # (to the wire, from it, checked)
_I64 = np.dtype("<i8")
# dtypes an ndarray field may carry (what the rank channel's graph steps hold)
ARRAY_DTYPES = frozenset({"int64", "int32", "float32", "float64", "bool"})


def _same(v: Any) -> Any:
    return v


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_float(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _scalar(ok: Callable[[Any], bool], what: str, cast: Callable[[Any], Any] = _same) -> Conv:
    def check(v: Any) -> Any:
        if not ok(v):
            raise TypeError(what)
        return cast(v)
    return _same, check


def _optional(inner: Conv) -> Conv:
    out, inn = inner
    return ((_same if out is _same else (lambda v: None if v is None else out(v))),
            lambda v: None if v is None else inn(v))


def _ints_in(v: Any) -> tuple[int, ...]:
    if not isinstance(v, (list, tuple)) or not all(_is_int(x) for x in v):
        raise TypeError("a list of integers")
    return tuple(v)


def _strs_in(v: Any) -> list[str]:
    if not isinstance(v, (list, tuple)) or not all(isinstance(x, str) for x in v):
        raise TypeError("a list of strings")
    return list(v)


def _str_str_dict_in(v: Any) -> dict[str, str]:
    if not isinstance(v, dict) or not all(isinstance(k, str) and isinstance(x, str)
                                          for k, x in v.items()):
        raise TypeError("a map of strings to strings")
    return dict(v)


def _str_dict_in(v: Any) -> dict[str, Any]:
    if not isinstance(v, dict) or not all(isinstance(k, str) for k in v):
        raise TypeError("a map with string keys")
    return v


def _packed_out(v: list[int]) -> bytes:
    return np.asarray(v, dtype=_I64).tobytes()


def _packed_in(v: Any) -> list[int]:
    if not isinstance(v, bytes) or len(v) % 8:
        raise TypeError("packed int64 bytes")
    out: list[int] = np.frombuffer(v, dtype=_I64).tolist()
    return out


def _array_out(a: np.ndarray) -> list[Any]:
    return [a.dtype.name, list(a.shape), np.ascontiguousarray(a).tobytes()]


def _array_in(v: Any) -> np.ndarray:
    if not (isinstance(v, (list, tuple)) and len(v) == 3 and v[0] in ARRAY_DTYPES
            and isinstance(v[1], (list, tuple)) and all(_is_int(n) and n >= 0 for n in v[1])
            and isinstance(v[2], bytes)):
        raise TypeError("an array [dtype, shape, bytes]")
    dtype = np.dtype(v[0])
    if len(v[2]) != int(np.prod(v[1], dtype=np.int64)) * dtype.itemsize:
        raise TypeError(f"an array whose bytes fill its shape {list(v[1])}")
    # a writable copy: torch.from_numpy warns on (and must not write into) a read-only view
    return np.frombuffer(bytearray(v[2]), dtype=dtype).reshape(v[1])


def _row_out(r: LogprobRow) -> list[Any]:
    return [r.token_id, r.logprob, [[t, p] for t, p in r.top]]


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


# Annotations with a wire form of their own; every other one is derived (see _conv).
BASE: dict[Any, Conv] = {
    str: _scalar(lambda v: isinstance(v, str), "a string"),
    int: _scalar(_is_int, "an integer"),
    float: _scalar(_is_float, "a number", float),
    bool: _scalar(lambda v: isinstance(v, bool), "a boolean"),
    bytes: _scalar(lambda v: isinstance(v, bytes), "bytes"),
    tuple[int, ...]: (list, _ints_in),
    dict[str, Any]: (_same, _str_dict_in),
    dict[str, str]: (_same, _str_str_dict_in),
    list[str]: (list, _strs_in),
    list[int]: (_packed_out, _packed_in),
    np.ndarray: (_array_out, _array_in),
    LogprobRow: (_row_out, _row_in),
}


@dataclass(frozen=True)
class _Shape:
    cls: type
    names: tuple[str, ...]
    required: int  # fields without a default
    out: tuple[Callable[[Any], Any], ...]
    inn: tuple[Callable[[Any], Any], ...]

    def fields_out(self, msg: Any) -> list[Any]:
        return [conv(getattr(msg, n)) for n, conv in zip(self.names, self.out, strict=True)]

    def build(self, values: Any, kind: str) -> Any:
        """One ``cls`` from its field list, every field checked. ``kind`` leads every error:
        the message's kind, "[i]" for an item of a list field, "" for a nested record."""
        if not isinstance(values, (list, tuple)):
            raise MessageError(f"{kind}: expected a list of fields")
        if not self.required <= len(values) <= len(self.names):
            missing = self.names[len(values)] if len(values) < self.required else None
            raise MessageError(f"{kind}.{missing}: missing field" if missing else
                               f"{kind}: {len(values)} fields, expected at most "
                               f"{len(self.names)}")
        args = {}
        for name, check, v in zip(self.names, self.inn, values, strict=False):
            try:
                args[name] = check(v)
            except TypeError as e:
                raise MessageError(f"{kind}.{name}: expected {e}, got {type(v).__name__}") \
                    from None
            except MessageError as e:  # a nested record's own field
                raise MessageError(f"{kind}.{name}{e}") from None
        try:
            return self.cls(**args)
        except ValueError as e:  # the record's own check of its values: "field: why"
            raise MessageError(f"{kind}.{e}") from None


def _conv(ann: Any, table: dict[Any, Conv]) -> Conv:
    if ann in table:
        return table[ann]
    origin, args = typing.get_origin(ann), typing.get_args(ann)
    if origin in (types.UnionType, typing.Union) and len(args) == 2 and type(None) in args:
        return _optional(_conv(next(a for a in args if a is not type(None)), table))
    if origin is list or (origin is tuple and len(args) == 2 and args[1] is Ellipsis):
        return _sequence(_conv(args[0], table))
    if origin is tuple:
        return _fixed(tuple(_conv(a, table) for a in args))
    if isinstance(ann, type) and issubclass(ann, enum.IntEnum):
        return _enum(ann)
    if isinstance(ann, type) and dataclasses.is_dataclass(ann):
        shape = _shape(ann, table)  # a record inside a message: its field list
        return shape.fields_out, lambda v: shape.build(v, "")
    raise TypeError(f"no wire form for the annotation {ann!r}")


def _sequence(inner: Conv) -> Conv:
    out, inn = inner

    def check(v: Any) -> tuple[Any, ...]:
        if not isinstance(v, (list, tuple)):
            raise TypeError("a list")
        items = []
        for i, x in enumerate(v):
            try:
                items.append(inn(x))
            except TypeError as e:
                raise MessageError(f"[{i}]: expected {e}, got {type(x).__name__}") from None
            except MessageError as e:  # a record item's own field
                raise MessageError(f"[{i}]{e}") from None
        return tuple(items)
    return (list if out is _same else (lambda v: [out(x) for x in v])), check


def _fixed(items: tuple[Conv, ...]) -> Conv:
    def check(v: Any) -> tuple[Any, ...]:
        if not isinstance(v, (list, tuple)) or len(v) != len(items):
            raise TypeError(f"a list of {len(items)} items")
        return tuple(c[1](x) for c, x in zip(items, v, strict=True))
    return (lambda v: [c[0](x) for c, x in zip(items, v, strict=True)]), check


def _enum(cls: type[enum.IntEnum]) -> Conv:
    def check(v: Any) -> Any:
        if not _is_int(v) or v not in cls._value2member_map_:
            raise TypeError(f"one of {[int(m) for m in cls]}")
        return cls(v)
    return int, check


def _shape(cls: type, table: dict[Any, Conv]) -> _Shape:
    hints = typing.get_type_hints(cls)
    fields = [f for f in dataclasses.fields(cls) if f.init]
    convs = [_conv(hints[f.name], table) for f in fields]
    required = sum(1 for f in fields if f.default is dataclasses.MISSING
                   and f.default_factory is dataclasses.MISSING)
    return _Shape(cls, tuple(f.name for f in fields), required,
                  tuple(c[0] for c in convs), tuple(c[1] for c in convs))


class Codec:
    """Encodes and decodes one channel's message classes (each a dataclass with ``KIND``)."""

    def __init__(self, classes: Iterable[type], extra: dict[Any, Conv] | None = None) -> None:
        """extra: wire forms of annotations beyond ``BASE`` (a channel's own types)."""
        table = {**BASE, **(extra or {})}
        self.by_kind: dict[str, _Shape] = {
            c.KIND: _shape(c, table) for c in classes}  # type: ignore[attr-defined]
        self.by_class: dict[type, _Shape] = {s.cls: s for s in self.by_kind.values()}

    def encode(self, msg: Any) -> bytes:
        shape = self.by_class[type(msg)]
        out: bytes = msgpack.packb([shape.cls.KIND, *shape.fields_out(msg)],  # type: ignore[attr-defined]
                                   use_bin_type=True)
        return out

    def decode(self, data: bytes) -> Any:
        try:
            raw = msgpack.unpackb(data, raw=False)
        except Exception as e:  # msgpack raises several unrelated types for bad bytes
            raise MessageError(f"message: not a valid msgpack message ({type(e).__name__}: "
                               f"{e})") from None
        if not isinstance(raw, list) or not raw or not isinstance(raw[0], str):
            raise MessageError("message: expected a list [kind, *fields]")
        shape = self.by_kind.get(raw[0])
        if shape is None:
            raise MessageError(f"kind: unknown message kind {raw[0]!r}")
        return shape.build(raw[1:], raw[0])
