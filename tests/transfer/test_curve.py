"""With a cluster token the KV control channel speaks ZMQ CURVE: a peer with another token
cannot finish a handshake, and the token never crosses the network in clear."""

from __future__ import annotations

import select
import socket
import threading
import time
from collections.abc import Iterator

import pytest
import torch
import zmq
from hostile import RawPeer, until
from xfer_helpers import LAYOUT, cfg, pool

from transfer import (
    HandshakeError,
    TransferNotice,
    TransferStatus,
    curve,
    make_receiver,
    make_sender,
)
from transfer.net_side import NetSide

TOKEN = "kv-curve-token-5f1e2d"


class Sniffer:
    """A TCP relay in front of the receiver's port that keeps every byte it relays."""

    def __init__(self, target: str) -> None:
        host, port = target.removeprefix("tcp://").rsplit(":", 1)
        self.target = (host, int(port))
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.address = f"tcp://127.0.0.1:{self.listener.getsockname()[1]}"
        self.seen = bytearray()
        self._stop = False
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        self.listener.settimeout(0.1)
        while not self._stop:
            try:
                a, _ = self.listener.accept()
            except TimeoutError:
                continue
            b = socket.create_connection(self.target)
            threading.Thread(target=self._relay, args=(a, b), daemon=True).start()

    def _relay(self, a: socket.socket, b: socket.socket) -> None:
        peer = {a: b, b: a}
        while not self._stop:
            ready, _, _ = select.select([a, b], [], [], 0.1)
            for s in ready:
                data = s.recv(65536)
                if not data:
                    return
                self.seen += data
                peer[s].sendall(data)

    def close(self) -> None:
        self._stop = True
        self._thread.join(5)
        self.listener.close()


@pytest.fixture
def rx() -> Iterator[object]:
    r = make_receiver(pool(fill=-1.0), LAYOUT, cfg("ucx", cluster_token=TOKEN))
    yield r
    r.close()


@pytest.mark.parametrize("curve", [True, False])
def test_a_sniffed_control_channel_holds_no_token_with_curve(curve: bool) -> None:
    src, dst = pool(), pool(fill=-1.0)
    rx = make_receiver(dst, LAYOUT, cfg("ucx", cluster_token=TOKEN, curve=curve))
    tx = make_sender(src, LAYOUT, cfg("ucx", cluster_token=TOKEN, curve=curve))
    sniff = Sniffer(rx.address)
    try:
        tx.connect(sniff.address, timeout=10)
        rx.expect("s", [2, 3])
        tx.push("s", sniff.address, [7, 8], [2, 3])
        tx.finish("s", TransferNotice("s", 1, False, 32))
        assert rx.wait("s", 10).status == TransferStatus.DONE
        assert tx.wait("s", 10).status == TransferStatus.DONE
        assert torch.equal(dst[2], src[7]) and torch.equal(dst[3], src[8])
        seen = bytes(sniff.seen)
        assert (b"CURVE" in seen) is curve  # the relay saw the ZMQ greeting
        # the control: without CURVE the HELLO carries the token in clear, and our messages'
        # fields (a handshake's layout, a push's request id) are readable
        assert (TOKEN.encode() in seen) is not curve
        assert (b"fingerprint" in seen) is not curve
        assert (b"rid" in seen) is not curve
    finally:
        sniff.close()
        tx.close()
        rx.close()


@pytest.mark.parametrize("token", ["", "another-token"])
def test_a_producer_without_the_token_cannot_finish_a_handshake(rx: object, token: str) -> None:
    tx = make_sender(pool(), LAYOUT, cfg("ucx", cluster_token=token))
    try:
        with pytest.raises(HandshakeError) as e:
            tx.connect(rx.address, timeout=10)  # type: ignore[attr-defined]
        # another token (a wrong CURVE key): ZMQ gives no detail, as for a peer that died
        # mid-handshake, so the message names both; no token: the consumer sees a protocol
        # error, the producer most often no detail (the consumer closed on it). Either way
        # the message names the token.
        assert str(e.value).startswith(  # type: ignore[attr-defined]
            f"consumer {rx.address}: ZMQ handshake failed: "), e.value
        if token:
            assert "no detail from ZMQ" in str(e.value), e.value
        assert "cluster token" in str(e.value), e.value
        assert tx.accounting().peers == 0
        assert rx.accounting().peers == 0  # type: ignore[attr-defined]
        until(lambda: rx.stats().rejected_handshakes >= 1)  # type: ignore[attr-defined]
        assert rx.stats().malformed_messages == 0  # type: ignore[attr-defined]  # never decoded
    finally:
        tx.close()


def test_a_handshake_over_before_the_hello_is_sent_is_a_handshake_error(
        rx: object, monkeypatch: pytest.MonkeyPatch) -> None:
    """On a loaded machine a CURVE mismatch can end the ZMQ handshake, and with it the
    pipe, before the HELLO is queued; the non-blocking send then raises zmq.Again (seen in
    CI), which once killed the producer's I/O thread. ZMQ_IMMEDIATE makes that the only
    order: a DEALER with it queues nothing until a handshake completes."""
    make = NetSide.control_socket

    def immediate(self: NetSide, kind: int) -> object:
        sock = make(self, kind)
        if kind == zmq.DEALER:
            sock.setsockopt(zmq.IMMEDIATE, 1)
        return sock

    monkeypatch.setattr(NetSide, "control_socket", immediate)
    tx = make_sender(pool(), LAYOUT, cfg("ucx", cluster_token="another-token"))
    try:
        with pytest.raises(HandshakeError, match="ZMQ handshake failed"):
            tx.connect(rx.address, timeout=10)  # type: ignore[attr-defined]
        # the I/O thread lived through it: a second try is answered the same way
        with pytest.raises(HandshakeError, match="ZMQ handshake failed"):
            tx.connect(rx.address, timeout=10)  # type: ignore[attr-defined]
        assert tx.accounting().peers == 0
    finally:
        tx.close()


def test_a_failed_handshake_is_seen_however_late_the_monitor_would_come(
        rx: object, monkeypatch: pytest.MonkeyPatch) -> None:
    """ZMQ does not retry a handshake that failed on a protocol error, so its event must
    not be raised before the monitor listens. A slow loop (CI's two cores) is made here by
    delaying the monitor's attachment: were it attached after the connect, the failure
    would be over by then and connect() would only time out (seen in CI)."""
    attach = NetSide.watch_handshakes

    def slowly(self: NetSide, sock: object) -> object:
        time.sleep(0.5)
        return attach(self, sock)

    monkeypatch.setattr(NetSide, "watch_handshakes", slowly)
    tx = make_sender(pool(), LAYOUT, cfg("ucx", cluster_token=""))
    try:
        with pytest.raises(HandshakeError, match="cluster token"):
            tx.connect(rx.address, timeout=10)  # type: ignore[attr-defined]
    finally:
        tx.close()


def test_a_raw_stranger_never_reaches_the_decoder(rx: object) -> None:
    raw = RawPeer(rx.address)  # type: ignore[attr-defined]
    try:
        raw.send(b"\xc1")
        until(lambda: rx.stats().rejected_handshakes >= 1)  # type: ignore[attr-defined]
        assert rx.stats().malformed_messages == 0  # type: ignore[attr-defined]
        assert rx.poll() == []  # type: ignore[attr-defined]
    finally:
        raw.close()


@pytest.mark.parametrize("event,says", [
    (zmq.EVENT_HANDSHAKE_FAILED_AUTH, "authentication failed (a wrong cluster token)"),
    (zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL, "a cluster token, so CURVE, on one side only"),
    # a wrong CURVE key and a peer that died mid-handshake look the same to ZMQ: both named
    (zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL, "a wrong or missing cluster token, or the peer "
                                           "closed the connection during the handshake")])
def test_a_failed_handshake_names_what_its_event_allows(event: int, says: str) -> None:
    assert says in curve.handshake_failure([event])
    # the most specific event of several wins
    assert says in curve.handshake_failure([zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL, event])
