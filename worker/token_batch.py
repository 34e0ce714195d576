"""A step's tokens on the engine -> gRPC process hop: per request (``TokensEvent``, what the
service's handlers and queues take) and per step as parallel columns (``TokensBatchEvent``,
what the engine process sends, built with ``TokensBatchBuilder``). ``worker.messages`` carries
both in its codec."""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

from engine.request import LogprobRow


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
    # consumer, P/D: the KV-ready part of the handoff split (``Handoff``)
    notice_sent_ns: int = 0
    notice_seen_ns: int = 0
    kv_done_ns: int = 0


@dataclass(frozen=True)
class Handoff:
    """A P/D request's handoff as the consumer stamped it (Unix ns, 0: unknown), sent once,
    with its first tokens: the producer handed the final notice to its sender, the
    consumer's receiver read it, then knew every KV block had landed (its DONE pollable),
    the consumer admitted the request (KV ready), and launched its first decode step."""

    notice_sent_ns: int = 0
    notice_seen_ns: int = 0
    kv_done_ns: int = 0
    kv_ready_ns: int = 0
    first_step_ns: int = 0


NO_HANDOFF = Handoff()  # a request's message after its first, or any but a consumer's


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
    ``timed`` (a consumer's first-message timestamps, ``Handoff``'s, and the prompt's cached
    tokens). With logprobs (any request of the step asked), ``lp_counts[i]`` rows belong to
    request ``i``; row ``r`` is token ``lp_ids[r]`` at ``lp_values[r]`` with
    ``top_counts[r]`` alternatives from ``top_ids`` / ``top_values``.
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
    # the rest of the ``timed`` group: ``Handoff``'s stamps, kept only with kv_ready_ns
    notice_sent_ns: list[int] = field(default_factory=list)
    notice_seen_ns: list[int] = field(default_factory=list)
    kv_done_ns: list[int] = field(default_factory=list)

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
        if self.timed or self.kv_ready_ns or self.first_step_ns or self.cached_tokens \
                or self.notice_sent_ns or self.notice_seen_ns or self.kv_done_ns:
            _indices("timed", self.timed, n)
            _same_len(len(self.timed), ("kv_ready_ns", self.kv_ready_ns),
                      ("first_step_ns", self.first_step_ns),
                      ("cached_tokens", self.cached_tokens),
                      ("notice_sent_ns", self.notice_sent_ns),
                      ("notice_seen_ns", self.notice_seen_ns),
                      ("kv_done_ns", self.kv_done_ns))
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
                  ev.kv_ready_ns, ev.first_step_ns, ev.cached_tokens, ev.notice_sent_ns,
                  ev.notice_seen_ns, ev.kv_done_ns)
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
        times = {i: t for i, *t in zip(
            self.timed, self.kv_ready_ns, self.first_step_ns, self.cached_tokens,
            self.notice_sent_ns, self.notice_seen_ns, self.kv_done_ns, strict=True)}
        rows = self.logprob_rows()
        starts = [0, *itertools.accumulate(self.counts)]
        out = []
        for i in range(len(self.rids)) if only is None else only:
            n, o = self.counts[i], starts[i]
            finish, stop, error = ends.get(i, (None, "", ""))
            stamps = times.get(i, _UNTIMED)
            out.append(TokensEvent(self.rids[i], tuple(self.ids[o:o + n]), self.texts[i],
                                   rows[i], finish, stop, error, *stamps))
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
        self.notice_sent_ns: list[int] = []
        self.notice_seen_ns: list[int] = []
        self.kv_done_ns: list[int] = []
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
            first_step_ns: int = 0, cached_tokens: int = 0, notice_sent_ns: int = 0,
            notice_seen_ns: int = 0, kv_done_ns: int = 0) -> None:
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
        # Handoff's other stamps are kept only with kv_ready_ns, stamped with them at the
        # consumer's admission: testing them too would cost every token of every step
        if kv_ready_ns or first_step_ns or cached_tokens:
            self.timed.append(i)
            self.kv_ready_ns.append(kv_ready_ns)
            self.first_step_ns.append(first_step_ns)
            self.cached_tokens.append(cached_tokens)
            self.notice_sent_ns.append(notice_sent_ns)
            self.notice_seen_ns.append(notice_seen_ns)
            self.kv_done_ns.append(kv_done_ns)
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
            self.top_ids, self.top_values, self.notice_sent_ns, self.notice_seen_ns,
            self.kv_done_ns)


_UNTIMED = (0, 0, 0, 0, 0, 0)  # a request without first-message stamps in a step
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
