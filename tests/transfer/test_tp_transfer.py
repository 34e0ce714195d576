"""KV transfer between a producer of TP a and a consumer of TP b, in one process.

Each producer rank is a sender over its own pool holding only its heads of one random
full-head KV; each consumer rank a receiver over its own pool. After a request, every
consumer rank's reserved blocks must equal its heads of the full KV byte for byte, the
bytes moved must be exactly what ``transfer.tp_plan`` says (a replicated head reaches each
consumer rank that needs it once, not once per producer replica) and every side's books
must be empty again.
"""

from __future__ import annotations

import contextlib
import random
import time
from collections.abc import Iterator, Sequence
from typing import Any

import pytest
import torch
from xfer_helpers import BACKENDS, cfg

from engine.kv_layout import KVLayout
from transfer import (
    Accounting,
    KVReceiver,
    KVSender,
    TransferConfig,
    TransferNotice,
    TransferStatus,
    make_receiver,
    make_sender,
)
from transfer.tp_plan import parts_from, plan

S = TransferStatus
TP_PAIRS = [(2, 1), (1, 2), (2, 2), (4, 2), (2, 4)]
NB, BS, LAYERS, DIM = 24, 4, 2, 8


def tp_cfg(backend: str) -> TransferConfig:
    # up to 12 sides (NIXL agents, UCX workers) start on a loaded 2-core CI host: give
    # handshakes and heartbeats room, so a slow start is not mistaken for a dead peer
    return cfg(backend, connect_timeout_s=30.0, peer_timeout_s=10.0, heartbeat_interval_s=1.0)


def layout(heads: int, tp: int, rank: int) -> KVLayout:
    return KVLayout("tiny-tp", "float32", BS, LAYERS, heads, DIM, NB, tp_size=tp, tp_rank=rank)


class TPPair:
    """A producer worker of ``a`` ranks and a consumer worker of ``b`` ranks."""

    def __init__(self, backend: str, a: int, b: int, heads: int) -> None:
        self.a, self.b, self.heads = a, b, heads
        self.plan_parts = plan(a, b, heads)
        self.ref = torch.randn(NB, LAYERS, 2, BS, heads, DIM)  # the full-head KV
        self.src_layouts = [layout(heads, a, p) for p in range(a)]
        self.dst_layouts = [layout(heads, b, c) for c in range(b)]
        self.src = [self._heads(self.ref, lay).contiguous() for lay in self.src_layouts]
        self.dst = [torch.full((NB, *lay.block_shape), -1.0) for lay in self.dst_layouts]
        self.rx: list[KVReceiver] = []
        self.tx: list[KVSender] = []
        try:
            for c, lay in enumerate(self.dst_layouts):
                self.rx.append(make_receiver(self.dst[c], lay, tp_cfg(backend),
                                             f"consumer-r{c}"))
            for p, lay in enumerate(self.src_layouts):
                self.tx.append(make_sender(self.src[p], lay, tp_cfg(backend), f"producer-r{p}"))
            for p in range(a):  # each producer rank connects to the consumer ranks it feeds
                for part in parts_from(p, a, b, heads):
                    self.tx[p].connect(self.rx[part.dst_rank].address, timeout=40)
        except BaseException:
            self.close()
            raise

    @staticmethod
    def _heads(kv: torch.Tensor, lay: KVLayout) -> torch.Tensor:
        return kv[..., lay.head_start:lay.head_start + lay.head_count, :]

    def targets(self, p: int) -> list[int]:
        return [part.dst_rank for part in parts_from(p, self.a, self.b, self.heads)]

    def start(self, rid: str, src: list[int], dst: list[int], chunk: int = 5,
              finish: bool = True) -> None:
        for rx in self.rx:
            rx.expect(rid, dst, source_tp=self.a)
        for p, tx in enumerate(self.tx):
            for c in self.targets(p):
                for i in range(0, len(src), chunk):  # chunked, as chunked prefill pushes
                    tx.push(rid, self.rx[c].address, src[i:i + chunk], dst[i:i + chunk])
            if finish and self.targets(p):
                tx.finish(rid, notice(rid))

    def sides(self) -> list[KVSender | KVReceiver]:
        return [*self.tx, *self.rx]

    def busy_sides(self) -> list[KVSender | KVReceiver]:
        """The ranks a request involves: a producer replica the plan leaves out has none."""
        return [*(tx for p, tx in enumerate(self.tx) if self.targets(p)), *self.rx]

    def close(self) -> None:
        for side in self.sides():
            side.close()


def notice(rid: str) -> TransferNotice:
    return TransferNotice(rid, 42, False, 77, seed=3)


@contextlib.contextmanager
def _make(backend: str, a: int, b: int, heads: int) -> Iterator[TPPair]:
    pair = TPPair(backend, a, b, heads)
    try:
        yield pair
    finally:
        pair.close()


@pytest.fixture(params=BACKENDS)
def backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def _empty(pair: TPPair) -> None:
    """Every record released and no operation posted, on every rank of both workers."""
    end = time.monotonic() + 30
    while True:
        books = [s.accounting() for s in pair.sides()]
        if all(x.transfers == 0 and x.ops_in_flight == 0 for x in books):
            return
        assert time.monotonic() < end, books
        time.sleep(0.01)


def matrix(full: Sequence[tuple[object, ...]], nixl: Sequence[tuple[object, ...]]) -> list[Any]:
    """Every case on fake, ucx and ipc; on nixl the cases in ``nixl`` (a NIXL agent takes
    seconds to start on a loaded host, and each case starts a + b of them), chosen so each
    TP pair and each kind of replication still runs there."""
    out: list[Any] = []
    bk: Any
    for bk in BACKENDS:
        name = bk if isinstance(bk, str) else bk.values[0]
        marks = () if isinstance(bk, str) else bk.marks
        out += [pytest.param(name, *case, marks=marks) for case in full
                if name != "nixl" or case in nixl]
    return out


DATA_CASES = [(a, b, h) for a, b in TP_PAIRS for h in (1, 2, 4)]
NIXL_DATA = [(2, 1, 1), (1, 2, 4), (2, 2, 2), (4, 2, 2), (2, 4, 1)]


@pytest.mark.parametrize(("backend", "a", "b", "heads"), matrix(DATA_CASES, NIXL_DATA))
def test_every_consumer_rank_gets_exactly_its_heads(backend: str, a: int, b: int,
                                                     heads: int) -> None:
    rng = random.Random(f"{a}{b}{heads}")
    with _make(backend, a, b, heads) as pair:
        src, dst = rng.sample(range(NB), 14), rng.sample(range(NB), 14)
        pair.start("r", src, dst)
        for side in pair.busy_sides():
            got = side.wait("r", 30)
            assert got.status == S.DONE, (side, got)
        for c, rx in enumerate(pair.rx):
            lay = pair.dst_layouts[c]
            want = TPPair._heads(pair.ref, lay)
            for s, d in zip(src, dst, strict=True):
                assert torch.equal(pair.dst[c][d], want[s]), (c, s, d)
            untouched = sorted(set(range(NB)) - set(dst))
            assert bool((pair.dst[c][untouched] == -1).all())
            # each consumer rank took its own heads exactly once, nothing more
            assert rx.stats().payload_bytes == len(src) * lay.block_nbytes
        # ... and what the producer ranks sent adds up to the same: no replica sent twice
        sent = sum(tx.stats().payload_bytes for tx in pair.tx)
        assert sent == sum(len(src) * lay.block_nbytes for lay in pair.dst_layouts)
        for side in pair.busy_sides():
            side.release("r")
        _empty(pair)
        for side in pair.sides():
            assert side.accounting().transfers == 0


def linked(a: int, b: int, heads: int, start: tuple[str, int]) -> set[tuple[str, int]]:
    """The ranks one request's cancel must reach from ``start``: ("tx", p) / ("rx", c)
    joined by the plan's parts (each rank's record ends its peers' as a whole)."""
    edges = [(("tx", p.src_rank), ("rx", p.dst_rank)) for p in plan(a, b, heads)]
    seen, todo = {start}, [start]
    while todo:
        x = todo.pop()
        for u, v in edges:
            for y in ((v,) if u == x else (u,) if v == x else ()):
                if y not in seen:
                    seen.add(y)
                    todo.append(y)
    return seen


CANCEL_CASES = [(a, b, h, who) for a, b, h in [(2, 1, 2), (1, 2, 2), (4, 2, 4), (2, 4, 1)]
                for who in ("consumer", "producer")]


@pytest.mark.parametrize(("backend", "a", "b", "heads", "who"),
                         matrix(CANCEL_CASES, [(2, 1, 2, "consumer"), (1, 2, 2, "producer")]))
def test_cancel_mid_way_ends_every_linked_rank_and_holds_nothing(
        backend: str, a: int, b: int, heads: int, who: str) -> None:
    with _make(backend, a, b, heads) as pair:
        src, dst = list(range(0, 12)), list(range(12, 24))
        for rx in pair.rx:
            rx.expect("c", dst, source_tp=a)
        # only the first half is pushed and nobody finishes: the request is mid-way
        for p, tx in enumerate(pair.tx):
            for c in pair.targets(p):
                tx.push("c", pair.rx[c].address, src[:6], dst[:6])
        _until(lambda: all(rx.status("c") == S.IN_FLIGHT for rx in pair.rx))
        start = ("rx", b - 1) if who == "consumer" else ("tx", pair.plan_parts[-1].src_rank)
        sides = {("tx", p): tx for p, tx in enumerate(pair.tx)} | {
            ("rx", c): rx for c, rx in enumerate(pair.rx)}
        reach = linked(a, b, heads, start)
        sides[start].cancel("c", "client went away")
        for key in sorted(reach):
            got = sides[key].wait("c", 30)
            assert got.status == S.CANCELLED, (key, got)
        others = [k for k in sides if k not in reach and (k[0] == "rx" or pair.targets(k[1]))]
        # another component of the plan is untouched: the worker cancels each rank itself
        assert [sides[k].status("c") for k in others] == [S.IN_FLIGHT] * len(others)
        for key in others:
            sides[key].cancel("c", "worker cancels every rank")
        for key in others:
            assert sides[key].wait("c", 30).status == S.CANCELLED, key
        for key in [*reach, *others]:
            sides[key].release("c")
        _empty(pair)


def test_a_producer_of_another_tp_than_expected_is_refused(backend: str) -> None:
    with _make(backend, 2, 1, 2) as pair:
        pair.rx[0].expect("w", [1, 2], source_tp=1)  # wrong: the producer is TP2
        pair.tx[0].push("w", pair.rx[0].address, [3, 4], [1, 2])
        got = pair.tx[0].wait("w", 15)
        assert got.status == S.FAILED and "expects tp_size 1" in (got.error or ""), got
        pair.rx[0].cancel("w")
        assert pair.rx[0].wait("w", 15).status == S.CANCELLED
        assert bool((pair.dst[0] == -1).all())


def test_a_producer_rank_with_none_of_the_heads_is_refused(backend: str) -> None:
    with _make(backend, 2, 2, 2) as pair:
        pair.tx[1].connect(pair.rx[0].address, timeout=40)  # rank 1 holds head 1, not 0
        pair.rx[0].expect("n", [1, 2], source_tp=2)
        pair.tx[1].push("n", pair.rx[0].address, [3, 4], [1, 2])
        got = pair.tx[1].wait("n", 15)
        err = got.error or ""
        assert got.status == S.FAILED and "heads" in err and "tp_plan" in err, got
        assert bool((pair.dst[0] == -1).all())


def _until(cond: object, timeout: float = 30.0) -> None:
    end = time.monotonic() + timeout
    while not cond():  # type: ignore[operator]
        assert time.monotonic() < end, "condition not reached"
        time.sleep(0.005)


def test_accounting_counts_peers_per_rank() -> None:
    with _make("fake", 1, 2, 2) as pair:
        assert pair.tx[0].accounting() == Accounting(0, 0, 2)
        assert [rx.accounting() for rx in pair.rx] == [Accounting(0, 0, 1)] * 2
