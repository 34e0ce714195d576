"""UCX may use only the network device of the address the transfer was given (it listens on
every device it may use); the live check of a worker's sockets is in tests/e2e/test_launch.py."""

from __future__ import annotations

import os
import socket

import pytest

from transfer import ucx_net
from transfer.ucx_net import interface_of, net_devices, restrict_to_host


def test_loopback_and_wildcards() -> None:
    lo = ucx_net._loopback_names()[0]
    assert net_devices("127.0.0.1") == net_devices("localhost") == lo
    assert net_devices("127.0.0.2") == lo  # all of 127/8 is the loopback interface
    for wild in ("0.0.0.0", "::", ""):
        assert net_devices(wild) is None  # every device, as the operator asked
    assert net_devices("no-such-host.invalid") is None


def test_an_interface_address_names_that_interface(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ucx_net, "_ib_ports", lambda: ["mlx5_0:1"])
    found = False
    for _, name in socket.if_nameindex():
        ip = ucx_net._ipv4_of(name)
        if ip is None or ip.startswith("127."):
            continue
        found = True
        assert interface_of(ip) == name
        assert net_devices(ip) == f"{name},mlx5_0:1"  # RDMA ports stay usable between hosts
    if not found:
        pytest.skip("no non-loopback IPv4 interface on this host")


def test_the_operators_setting_wins(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("UCX_NET_DEVICES", "eth9")
    monkeypatch.delenv(ucx_net.MARK, raising=False)
    restrict_to_host("127.0.0.1")
    assert os.environ["UCX_NET_DEVICES"] == "eth9"
    monkeypatch.delenv("UCX_NET_DEVICES")
    restrict_to_host("127.0.0.1")
    assert os.environ["UCX_NET_DEVICES"] == ucx_net._loopback_names()[0]
    # ... but its own choice, inherited by a process bound elsewhere, is made again
    restrict_to_host("0.0.0.0")
    assert "UCX_NET_DEVICES" not in os.environ and ucx_net.MARK not in os.environ
