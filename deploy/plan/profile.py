"""The worker profile: what one worker costs on its device, as ``pdserve plan`` reads it.

File format, version 1 (JSON)::

    {"version": 1, "model": str, "device": str, "block_size": int,
     "prefill": {"tokens": [int...], "ms": [float...]},
     "decode": {"batch": [int...], "context": [int...], "ms": [[float per context] per batch]},
     "kv_capacity_tokens": int, "kv_bytes_per_token": int, "transfer_GBps": float}

Attention data parallelism (a worker of ``--tensor-parallel-size T --data-parallel-size D``,
written only when D > 1): ``tp_size`` and ``dp_size``. Then ``kv_capacity_tokens`` is one
attention group's pool and ``prefill.tokens`` / ``decode.batch`` count one group's part of
a step: every group runs that much at once (the groups step together, their MoE layers
shared), and the step costs what one group's part costs in the profile.

Optional keys (written by `pdserve plan profile`): ``prefill.spread`` and ``decode.spread``
(same shapes as ``ms``: each point's relative spread, (max - min) / median of the timings
kept), ``tolerance`` (the spread a point had to get under) and ``problems`` (one line per
noisy or out-of-order point). `pdserve plan` refuses a profile with problems, those stored
and those it finds itself (a curve that falls where cost must grow).

``prefill.ms[i]`` is one engine step that computes ``prefill.tokens[i]`` prompt tokens;
``decode.ms[b][c]`` is one decode step of ``decode.batch[b]`` sequences whose context is
``decode.context[c]`` tokens each. Grids are strictly increasing.

Interpolation is linear between grid points (bilinear for decode). Outside the grid the
value is clamped below the first point (a step never costs less than the smallest one
measured: fixed per-step overhead dominates there) and extrapolated linearly past the last
point (compute grows with tokens; the last two points give the slope, never negative).

``device`` also says how a step's output reaches the client from a worker that defers its
output (consumer, colocated: overlap scheduling reads step N's tokens after launching step
N+1). On a GPU the launch is asynchronous, so the read waits only for step N itself. On
the CPU a launch computes the step, so step N's tokens show once step N+1 is done
(``sync_steps``); the simulator models both.
"""

from __future__ import annotations

import bisect
import json
from dataclasses import asdict, dataclass
from typing import Any

VERSION = 1
DEFAULT_TOLERANCE = 0.15  # relative spread of a point's timings under which they agree


class ProfileError(ValueError):
    """A profile file that does not follow the format; the message names the key."""


def _interp(xs: tuple[int, ...], ys: tuple[float, ...], x: float) -> float:
    if len(xs) == 1 or x <= xs[0]:
        return ys[0]
    i = bisect.bisect_right(xs, x)
    if i >= len(xs):  # past the last point: the last segment's slope, not below flat
        i = len(xs) - 1
        slope = max(0.0, (ys[i] - ys[i - 1]) / (xs[i] - xs[i - 1]))
        return ys[i] + slope * (x - xs[i])
    x0, x1 = xs[i - 1], xs[i]
    return ys[i - 1] + (ys[i] - ys[i - 1]) * (x - x0) / (x1 - x0)


@dataclass(frozen=True)
class PrefillCurve:
    tokens: tuple[int, ...]
    ms: tuple[float, ...]


@dataclass(frozen=True)
class DecodeGrid:
    batch: tuple[int, ...]
    context: tuple[int, ...]
    ms: tuple[tuple[float, ...], ...]  # [batch index][context index]


@dataclass(frozen=True)
class Profile:
    model: str
    device: str
    block_size: int
    prefill: PrefillCurve
    decode: DecodeGrid
    kv_capacity_tokens: int
    kv_bytes_per_token: int
    transfer_GBps: float
    version: int = VERSION
    prefill_spread: tuple[float, ...] = ()  # per prefill point; () when not measured
    decode_spread: tuple[tuple[float, ...], ...] = ()  # [batch index][context index]
    tolerance: float = DEFAULT_TOLERANCE  # the spread a point had to get under
    problems: tuple[str, ...] = ()  # what the measurement found wrong, one line each
    tp_size: int = 1  # ranks of the profiled worker
    dp_size: int = 1  # its attention data-parallel groups (capacity and batch are per group)

    @property
    def sync_steps(self) -> bool:
        """Launching a step computes it (CPU): deferred output shows one step later."""
        return self.device == "cpu" or self.device.startswith("cpu:")

    # -- interpolation ------------------------------------------------------------------

    def prefill_ms(self, tokens: float) -> float:
        """One step computing ``tokens`` prompt tokens."""
        return _interp(self.prefill.tokens, self.prefill.ms, tokens)

    def decode_ms(self, batch: float, context: float) -> float:
        """One decode step of ``batch`` sequences of ``context`` tokens each."""
        d = self.decode
        per_batch = tuple(_interp(d.context, row, context) for row in d.ms)
        return _interp(d.batch, per_batch, batch)

    def transfer_ms(self, tokens: int) -> float:
        """Moving the KV of ``tokens`` tokens between two workers."""
        return tokens * self.kv_bytes_per_token / (self.transfer_GBps * 1e9) * 1e3

    @property
    def kv_capacity_blocks(self) -> int:
        return self.kv_capacity_tokens // self.block_size

    # -- the file -----------------------------------------------------------------------

    def trust_problems(self) -> list[str]:
        """Why this profile cannot be trusted: the problems its measurement recorded and
        those visible in its numbers; [] when it can be."""
        found = problems(self, self.tolerance)
        return [*self.problems, *(p for p in found if p not in self.problems)]

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        for key in ("prefill_spread", "decode_spread", "tolerance", "problems"):
            d.pop(key)
        if self.dp_size == 1:
            d.pop("tp_size")
            d.pop("dp_size")
        d["prefill"] = {"tokens": list(self.prefill.tokens), "ms": list(self.prefill.ms)}
        d["decode"] = {"batch": list(self.decode.batch), "context": list(self.decode.context),
                       "ms": [list(r) for r in self.decode.ms]}
        if self.prefill_spread:
            d["prefill"]["spread"] = list(self.prefill_spread)
        if self.decode_spread:
            d["decode"]["spread"] = [list(r) for r in self.decode_spread]
        if self.prefill_spread or self.decode_spread:
            d["tolerance"] = self.tolerance
            d["problems"] = list(self.problems)
        return {"version": self.version, **{k: v for k, v in d.items() if k != "version"}}

    def save(self, path: str) -> None:
        with open(path, "w", encoding="utf-8") as f:
            json.dump(self.to_json(), f, indent=1)
            f.write("\n")

    @staticmethod
    def load(path: str) -> Profile:
        try:
            with open(path, encoding="utf-8") as f:
                data = json.load(f)
        except OSError as e:
            raise ProfileError(f"--profile: cannot read {path}: {e.strerror}") from None
        except json.JSONDecodeError as e:
            raise ProfileError(f"--profile: {path} is not JSON: {e}") from None
        return Profile.from_json(data)

    @staticmethod
    def from_json(data: Any) -> Profile:
        if not isinstance(data, dict):
            raise ProfileError("profile: expected a JSON object")
        version = _field(data, "version", int)
        if version != VERSION:
            raise ProfileError(f"profile: version: this pdserve reads version {VERSION}, "
                               f"got {version}")
        pre = _field(data, "prefill", dict)
        dec = _field(data, "decode", dict)
        tokens = _grid(pre, "prefill.tokens", "tokens")
        pms = _floats(_field(pre, "ms", list, "prefill.ms"), "prefill.ms", len(tokens))
        batch = _grid(dec, "decode.batch", "batch")
        context = _grid(dec, "decode.context", "context")
        rows = _field(dec, "ms", list, "decode.ms")
        if len(rows) != len(batch):
            raise ProfileError(f"profile: decode.ms: expected {len(batch)} rows (one per "
                               f"batch), got {len(rows)}")
        dms = tuple(_floats(r, f"decode.ms[{i}]", len(context)) if isinstance(r, list)
                    else _bad(f"decode.ms[{i}]", "a list of numbers", r)
                    for i, r in enumerate(rows))
        psp = _spreads(pre.get("spread"), "prefill.spread", len(tokens))
        dsp_raw = dec.get("spread")
        if dsp_raw is not None and (not isinstance(dsp_raw, list) or len(dsp_raw) != len(batch)):
            _bad("decode.spread", f"a list of {len(batch)} rows", dsp_raw)
        dsp = tuple(_spreads(r, f"decode.spread[{i}]", len(context))
                    for i, r in enumerate(dsp_raw or ()))
        tol = data.get("tolerance", DEFAULT_TOLERANCE)
        if isinstance(tol, bool) or not isinstance(tol, (int, float)) or not tol > 0:
            _bad("tolerance", "a positive number", tol)
        probs = data.get("problems", [])
        if not isinstance(probs, list) or not all(isinstance(x, str) for x in probs):
            _bad("problems", "a list of strings", probs)
        tp, dp = data.get("tp_size", 1), data.get("dp_size", 1)
        for key, v in (("tp_size", tp), ("dp_size", dp)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                _bad(key, "a positive integer", v)
        if tp % dp:
            _bad("dp_size", f"a divisor of tp_size {tp}", dp)
        p = Profile(model=_field(data, "model", str), device=_field(data, "device", str),
                    block_size=_field(data, "block_size", int),
                    prefill=PrefillCurve(tokens, pms), decode=DecodeGrid(batch, context, dms),
                    kv_capacity_tokens=_field(data, "kv_capacity_tokens", int),
                    kv_bytes_per_token=_field(data, "kv_bytes_per_token", int),
                    transfer_GBps=float(_field(data, "transfer_GBps", (int, float))),
                    prefill_spread=psp, decode_spread=dsp, tolerance=float(tol),
                    problems=tuple(probs), tp_size=tp, dp_size=dp)
        for key in ("block_size", "kv_capacity_tokens", "kv_bytes_per_token", "transfer_GBps"):
            if getattr(p, key) <= 0:
                raise ProfileError(f"profile: {key}: must be > 0, got {getattr(p, key)}")
        if p.kv_capacity_tokens < p.block_size:
            raise ProfileError("profile: kv_capacity_tokens: smaller than one block")
        return p


def _spreads(v: Any, key: str, n: int) -> tuple[float, ...]:
    if v is None:
        return ()
    if not isinstance(v, list) or len(v) != n or any(
            isinstance(x, bool) or not isinstance(x, (int, float)) or x < 0 for x in v):
        _bad(key, f"{n} non-negative numbers (one per grid point)", v)
    return tuple(float(x) for x in v)


def _bad(key: str, what: str, value: Any) -> Any:
    raise ProfileError(f"profile: {key}: expected {what}, got {value!r}")


def _field(d: dict[str, Any], name: str, typ: Any, key: str | None = None) -> Any:
    key = key or name
    if name not in d:
        raise ProfileError(f"profile: {key}: missing")
    v = d[name]
    if isinstance(v, bool) or not isinstance(v, typ):
        names = typ.__name__ if isinstance(typ, type) else " or ".join(t.__name__ for t in typ)
        _bad(key, names, v)
    return v


def _grid(d: dict[str, Any], key: str, name: str) -> tuple[int, ...]:
    v = _field(d, name, list, key)
    if not v or any(isinstance(x, bool) or not isinstance(x, int) or x < 1 for x in v):
        _bad(key, "a non-empty list of positive integers", v)
    if any(b <= a for a, b in zip(v, v[1:], strict=False)):
        _bad(key, "strictly increasing values", v)
    return tuple(v)


def _floats(v: list[Any], key: str, n: int) -> tuple[float, ...]:
    if len(v) != n:
        raise ProfileError(f"profile: {key}: expected {n} values (one per grid point), "
                           f"got {len(v)}")
    if any(isinstance(x, bool) or not isinstance(x, (int, float)) or x <= 0 for x in v):
        _bad(key, "positive numbers (milliseconds)", v)
    return tuple(float(x) for x in v)


# A later grid point may cost less than an earlier one by this much before it counts as
# out of order: at the smallest sizes a step's fixed cost dominates and timings are flat.
MONOTONE_SLACK = 0.10


def out_of_order(xs: tuple[int, ...], ys: list[float],
                 spreads: tuple[float, ...] | list[float] = ()) -> list[int]:
    """Indexes i whose value falls below the one before by more than the slack, or than
    the two points' own spreads when those are larger (their noise explains that much)."""
    sp = list(spreads) or [0.0] * len(ys)
    return [i for i in range(1, len(ys))
            if ys[i] < ys[i - 1] * (1 - max(MONOTONE_SLACK, sp[i - 1] + sp[i]))]


def problems(profile: Profile, tolerance: float) -> list[str]:
    """What makes a profile untrustworthy: noisy points and curves that fall where cost
    must grow (more tokens, a bigger batch, a longer context). One line each."""
    out = []
    pre, dec = profile.prefill, profile.decode
    for t, ms, sp in zip(pre.tokens, pre.ms, profile.prefill_spread or (), strict=False):
        if sp > tolerance:
            out.append(f"prefill {t} tokens: noisy ({ms:.2f} ms, spread {100 * sp:.0f}%)")
    for i in out_of_order(pre.tokens, list(pre.ms), profile.prefill_spread):
        out.append(f"prefill {pre.tokens[i]} tokens takes {pre.ms[i]:.2f} ms, less than "
                   f"{pre.tokens[i - 1]} tokens ({pre.ms[i - 1]:.2f} ms)")
    for b, row in enumerate(dec.ms):
        sps = profile.decode_spread[b] if profile.decode_spread else ()
        for c, (ms, sp) in enumerate(zip(row, sps, strict=False)):
            if sp > tolerance:
                out.append(f"decode batch {dec.batch[b]} context {dec.context[c]}: noisy "
                           f"({ms:.2f} ms, spread {100 * sp:.0f}%)")
        for c in out_of_order(dec.context, list(row), sps):
            out.append(f"decode batch {dec.batch[b]}: context {dec.context[c]} takes "
                       f"{row[c]:.2f} ms, less than context {dec.context[c - 1]} "
                       f"({row[c - 1]:.2f} ms)")
    for c in range(len(dec.context)):
        col = [row[c] for row in dec.ms]
        col_sp = [r[c] for r in profile.decode_spread] if profile.decode_spread else []
        for b in out_of_order(dec.batch, col, col_sp):
            out.append(f"decode context {dec.context[c]}: batch {dec.batch[b]} takes "
                       f"{col[b]:.2f} ms, less than batch {dec.batch[b - 1]} "
                       f"({col[b - 1]:.2f} ms)")
    return out
