"""Connecting never blocks the caller: pushes wait on a handshake in flight, and a
consumer that never answers fails only its own requests, through poll(), in bounded time."""

from __future__ import annotations

import socket
import threading
import time

import pytest
import torch
from hostile import RawPeer
from xfer_helpers import LAYOUT, NET_BACKENDS, cfg, pool

from transfer import (
    Accounting,
    TransferError,
    TransferNotice,
    TransferStatus,
    make_receiver,
    make_sender,
)

S = TransferStatus
CONNECT_S = 4.0  # covers the ucx plane probe starting on a busy host


def _closed_port() -> str:
    with socket.socket() as s:  # bound then closed: nothing listens there
        s.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{s.getsockname()[1]}"


@pytest.mark.parametrize("backend", NET_BACKENDS)
def test_unreachable_consumers_fail_alone_while_a_reachable_one_proceeds(backend: str) -> None:
    src, dst = pool(), pool(fill=-1.0)
    silent = RawPeer()  # accepts the TCP connection, never answers the HELLO
    rx = make_receiver(dst, LAYOUT, cfg(backend))
    tx = make_sender(src, LAYOUT, cfg(backend, connect_timeout_s=CONNECT_S))
    try:
        dead = [_closed_port(), silent.address]
        t0 = time.monotonic()
        for i, addr in enumerate(dead):
            tx.connect(addr)
            tx.push(f"dead{i}", addr, [1, 2], [3, 4])
            tx.finish(f"dead{i}", TransferNotice(f"dead{i}", 1, False, 32))
        tx.connect(rx.address)
        assert time.monotonic() - t0 < 0.5  # the engine thread was never held up
        rx.expect("live", [10, 11, 12])
        tx.push("live", rx.address, [5, 6, 7], [10, 11, 12])  # queued behind its handshake
        tx.finish("live", TransferNotice("live", 2, False, 48))
        assert rx.wait("live", 10).status == S.DONE
        assert tx.wait("live", 10).status == S.DONE
        assert time.monotonic() - t0 < CONNECT_S  # it did not wait for the dead ones
        for b in range(3):
            assert torch.equal(dst[10 + b], src[5 + b])
        for i, addr in enumerate(dead):
            got = tx.wait(f"dead{i}", CONNECT_S + 3)
            assert got.status == S.FAILED, got
            assert addr in (got.error or "") and "handshake" in (got.error or ""), got
        assert time.monotonic() - t0 < CONNECT_S + 3
        for rid in ("live", "dead0", "dead1"):
            tx.release(rid)
        rx.release("live")
        assert tx.accounting() == Accounting(0, 0, 1)
    finally:
        tx.close()
        rx.close()
        silent.close()


def test_cancel_while_connecting_ends_the_request_and_welcome_does_not_revive_it() -> None:
    src, dst = pool(), pool(fill=-1.0)
    rx = make_receiver(dst, LAYOUT, cfg("ucx"))
    tx = make_sender(src, LAYOUT, cfg("ucx"))
    entered, go = threading.Event(), threading.Event()
    inner = rx.on_readable  # type: ignore[attr-defined]

    def held(sock: object) -> None:  # the consumer answers the HELLO only when let go
        entered.set()
        go.wait(10)
        inner(sock)

    rx.on_readable = held  # type: ignore[attr-defined]
    try:
        rx.expect("c", [8])
        tx.connect(rx.address)
        tx.push("c", rx.address, [1], [8])
        tx.cancel("c", "client went away")
        assert tx.wait("c", 10).status == S.CANCELLED  # ended while still handshaking
        tx.release("c")
        assert entered.wait(10)
        go.set()  # now the WELCOME: nothing queued for "c" may run
        end = time.monotonic() + 10
        while tx.accounting().peers != 1:
            assert time.monotonic() < end
            time.sleep(0.01)
        time.sleep(0.2)
        assert tx.accounting() == Accounting(0, 0, 1)
        assert bool((dst[8] == -1).all())
        assert rx.status("c") == S.PENDING  # no push ever reached the consumer
        rx.cancel("c")
        rx.wait("c", 10)
    finally:
        go.set()
        tx.close()
        rx.close()


@pytest.mark.parametrize("address", ["", "10.0.0.1:5", "tcp://host", "tcp://h:0",
                                     "tcp://h:99999", "ipc:///tmp/x", "tcp://a b:5"])
def test_connect_raises_only_for_an_address_that_cannot_be_parsed(address: str) -> None:
    with make_sender(pool(), LAYOUT, cfg("ucx")) as tx:
        with pytest.raises(TransferError, match="tcp://HOST:PORT"):
            tx.connect(address)
        assert tx.accounting().peers == 0
