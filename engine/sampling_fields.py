"""The sampling fields, one row each: type, range, default, and how the wire's value becomes
the engine's. The router's validation, the worker's conversion and ``SamplingParams`` all
read this table, so a request the router accepts is exactly the request the engine runs.

Why float32 rounding lives here: the wire (protobuf ``float``) holds float32, so a client's
0.1 arrives as 0.10000000149011612. Every reader turns it into the shortest decimal that is
the same float32 (0.1) with ``f32``; a value that is > 0 as float64 but 0 as float32
(temperature 1e-46) is 0 (greedy) for everyone, and top_p 1.0000001 (float32 just above
1) is refused by everyone, instead of the router checking one number and the engine
running another.

Torch-free and proto-free: messages are read by duck typing (``getattr``/``HasField``).
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass
from typing import Any

MAX_LOGPROBS = 20  # top-N alternatives per token
MAX_STOP = 16  # stop strings per request: each is checked after every token
MAX_STOP_TOKEN_IDS = 1024
SEED_LIMIT = 1 << 63  # seeds are in [0, 2**63)


@dataclass(frozen=True)
class SamplingField:
    name: str
    kind: str  # "int", "float" (float32 on the wire), "bool", "strings" or "ids"
    default: Any
    lo: float | None = None  # smallest allowed value (None: unbounded)
    hi: float | None = None  # largest allowed value
    lo_open: bool = False  # lo itself is not allowed
    optional: bool = False  # presence is tracked on the wire: unset means `default`
    max_items: int = 0  # lists: at most this many items (0: unbounded)
    rule: str = ""  # the range in words, for errors (derived from lo/hi when empty)

    def range_text(self) -> str:
        if self.rule:
            return self.rule
        if self.lo is not None and self.hi is not None:
            return f"must be in {'(' if self.lo_open else '['}{self.lo:g}, {self.hi:g}]"
        if self.lo is not None:
            return f"must be {'>' if self.lo_open else '>='} {self.lo:g}"
        return ""

    def in_range(self, v: float) -> bool:
        if self.lo is not None and (v <= self.lo if self.lo_open else v < self.lo):
            return False
        return self.hi is None or v <= self.hi


FIELDS: tuple[SamplingField, ...] = (
    SamplingField("max_tokens", "int", 16, lo=1, optional=True),  # token 0 included
    # EOS and stop token ids are masked until this many were produced; <= max_tokens
    SamplingField("min_tokens", "int", 0, lo=0, rule="must be in [0, max_tokens]"),
    SamplingField("temperature", "float", 1.0, lo=0, optional=True),  # 0: greedy
    SamplingField("top_p", "float", 1.0, lo=0, hi=1, lo_open=True, optional=True),
    SamplingField("top_k", "int", 0, lo=-1, rule="must be -1, 0 (off) or positive"),
    SamplingField("min_p", "float", 0.0, lo=0, hi=1),
    SamplingField("repetition_penalty", "float", 1.0, lo=0, lo_open=True, optional=True),
    SamplingField("frequency_penalty", "float", 0.0, lo=-2, hi=2),
    SamplingField("presence_penalty", "float", 0.0, lo=-2, hi=2),
    SamplingField("stop", "strings", (), max_items=MAX_STOP),
    SamplingField("stop_token_ids", "ids", (), max_items=MAX_STOP_TOKEN_IDS),
    SamplingField("ignore_eos", "bool", False),
    SamplingField("seed", "int", None, lo=0, hi=SEED_LIMIT - 1, optional=True,
                  rule="must be an integer in [0, 2**63)"),
    SamplingField("logprobs", "int", None, lo=0, hi=MAX_LOGPROBS, optional=True,
                  rule=f"must be an integer in [0, {MAX_LOGPROBS}]"),
    SamplingField("skip_special_tokens", "bool", True, optional=True),
    SamplingField("include_stop_str_in_output", "bool", False),
)
BY_NAME = {f.name: f for f in FIELDS}


def f32(x: float) -> float:
    """The shortest decimal that is the same float32 as x (what the client most likely
    meant), so 0.1 sent as float32 is 0.1 again; NaN and infinities pass through."""
    if not math.isfinite(x):
        return float(x)
    try:
        (want,) = struct.unpack("<f", struct.pack("<f", x))
    except OverflowError:  # past the float32 range: as float32 it is an infinity
        return math.copysign(math.inf, x)
    for digits in range(1, 10):  # 9 significant digits always round-trip a float32
        y = float(f"{want:.{digits}g}")
        try:
            same = struct.unpack("<f", struct.pack("<f", y))[0] == want
        except OverflowError:  # near the float32 maximum a short decimal rounds past it
            continue
        if same:
            return y
    return float(want)


def wire_values(msg: Any) -> dict[str, Any]:
    """The engine's values for a wire SamplingParams (a protobuf message or anything with
    the same attributes and ``HasField``): unset optional fields are left out so the
    engine's defaults apply, floats are rounded by ``f32``, lists become lists."""
    out: dict[str, Any] = {}
    for f in FIELDS:
        if f.optional and not msg.HasField(f.name):
            continue
        v = getattr(msg, f.name)
        if f.kind == "float":
            v = f32(v)
        elif f.kind in ("strings", "ids"):
            v = list(v)
        out[f.name] = v
    # structured output is a message, not a table row (engine.grammar.spec)
    if getattr(msg, "structured", None) is not None and msg.HasField("structured"):
        out["structured"] = {"kind": msg.structured.kind, "value": msg.structured.value}
    return out


def check(values: dict[str, Any]) -> None:
    """ValueError("<field>: <why>, got <value>") for the first bad field of `values` (the
    engine's full set of fields)."""
    for f in FIELDS:
        v = values[f.name]
        if v is None and f.default is None:
            continue
        why = _bad(f, v)
        if why:
            raise ValueError(f"{f.name}: {why}, got {_show(v)}")
    if values["min_tokens"] > values["max_tokens"]:
        raise ValueError(f"min_tokens: {BY_NAME['min_tokens'].rule}, got "
                         f"{values['min_tokens']}")


def _bad(f: SamplingField, v: Any) -> str:
    if f.kind == "int":
        if not isinstance(v, int) or isinstance(v, bool):
            return f.rule if f.rule.startswith("must be an integer") else "must be an integer"
        return "" if f.in_range(v) else f.range_text()
    if f.kind == "float":
        if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v):
            return "must be a finite number"
        return "" if f.in_range(v) else f.range_text()
    if f.kind == "bool":
        return "" if isinstance(v, bool) else "must be a boolean"
    if f.kind == "strings":
        if not isinstance(v, list) or not all(isinstance(s, str) for s in v):
            return "must be a string or a list of strings"
        if any(s == "" for s in v):
            return "stop strings must not be empty"
    elif f.kind == "ids":
        if not isinstance(v, list) or not all(
                isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in v):
            return "must be a list of non-negative integers"
    if f.max_items and len(v) > f.max_items:
        return f"at most {f.max_items} items"
    return ""


def _show(v: Any) -> str:
    s = repr(v)
    return s if len(s) <= 60 else s[:57] + "..."
