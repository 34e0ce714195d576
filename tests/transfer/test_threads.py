"""The threads a network transfer side adds to an engine process: named (so ``top -H`` and
py-spy tell them from the engine loop), and quiet while nothing moves, without making a
transfer wait for a timer."""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Iterator

import pytest
import torch
from xfer_helpers import LAYOUT, Pair, cfg, pool

from transfer import TransferNotice, TransferStatus, make_receiver, make_sender


@pytest.fixture(scope="module")
def ucx_pair() -> Iterator[Pair]:
    p = Pair("ucx")
    yield p
    p.close()


def _threads() -> dict[int, str]:
    out = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                out[int(tid)] = f.read().strip()
        except OSError:  # the thread ended meanwhile
            pass
    return out


def _wakeups(tid: int) -> int:
    """Voluntary context switches of a thread: one per sleep it woke from."""
    with open(f"/proc/self/task/{tid}/status") as f:
        for line in f:
            if line.startswith("voluntary_ctxt_switches:"):
                return int(line.split()[1])
    raise AssertionError(f"no voluntary_ctxt_switches for thread {tid}")


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="needs Linux /proc")
def test_transfer_threads_are_named(ucx_pair: Pair) -> None:
    names = sorted(_threads().values())
    assert "consumer-io" in names and "producer-io" in names, names
    assert names.count("ucx-progress") == 2, names  # one per side's UCX worker


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="needs Linux /proc")
def test_idle_ucx_progress_threads_sleep(ucx_pair: Pair) -> None:
    """An idle worker's UCX progress threads wake a few times a second at most (they woke
    every millisecond: a thousand wakeups a second beside the engine's thread)."""
    tids = [t for t, n in _threads().items() if n == "ucx-progress"]
    assert len(tids) == 2
    before = [_wakeups(t) for t in tids]
    time.sleep(1.0)
    woke = [_wakeups(t) - b for t, b in zip(tids, before, strict=True)]
    assert max(woke) < 100, woke


def test_a_transfer_is_not_held_by_the_progress_threads_sleep(ucx_pair: Pair) -> None:
    """Posting and completing a run wake the progress thread at once, so a one-block
    request is pushed, landed and acknowledged in milliseconds, not in sleep periods."""
    p = ucx_pair
    took = []
    for i in range(5):
        rid = f"one-{i}"
        p.rx.expect(rid, [10 + i])
        t0 = time.perf_counter()
        p.tx.push(rid, p.addr, [i], [10 + i])
        p.tx.finish(rid, TransferNotice(rid, 42, False, 1))
        assert p.tx.wait(rid, 10).status == TransferStatus.DONE  # the consumer's ack
        took.append(time.perf_counter() - t0)
        assert p.rx.wait(rid, 10).status == TransferStatus.DONE
        p.rx.release(rid)
        p.tx.release(rid)
    assert statistics.median(took) < 0.05, took  # the sleep is 0.1 s


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="needs Linux /proc")
def test_an_idle_receiver_wakes_for_its_heartbeats_only() -> None:
    """With no transfer open, a consumer's I/O thread sleeps until its next ping is due
    (it woke every 50 ms, each time taking the GIL from the engine loop), and a transfer
    that starts meanwhile is served at once."""
    c = cfg("ucx", heartbeat_interval_s=1.0, peer_timeout_s=5.0)
    src, dst = pool(), pool(fill=-1.0)
    with make_receiver(dst, LAYOUT, c, name="quietrx") as rx, \
            make_sender(src, LAYOUT, c, name="quiettx") as tx:
        tx.connect(rx.address, timeout=10)
        (tid,) = [t for t, n in _threads().items() if n == "quietrx-io"]
        time.sleep(0.5)  # the handshake's turns are over
        before = _wakeups(tid)
        time.sleep(2.0)
        woke = _wakeups(tid) - before
        # a ping each way a second, each a wakeup or two: ~4 in 2 s (was 40+)
        assert woke < 16, woke
        rx.expect("r", [3])
        t0 = time.perf_counter()
        tx.push("r", rx.address, [1], [3])
        tx.finish("r", TransferNotice("r", 42, False, 1))
        assert rx.wait("r", 10).status == TransferStatus.DONE
        assert time.perf_counter() - t0 < 0.5
        assert torch.equal(dst[3], src[1])
        # a side still connected keeps its peer: the silence verdict was not hurried
        assert rx.accounting().peers == 1
