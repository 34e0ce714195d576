"""Two test hosts on one machine: network namespaces joined by a veth pair."""

from __future__ import annotations

import contextlib
import shutil
import subprocess
from collections.abc import Iterator

import pytest


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=10)


@contextlib.contextmanager
def two_hosts(names: tuple[str, str], addrs: tuple[str, str],
              devs: tuple[str, str]) -> Iterator[None]:
    """Creates namespaces `names` with `addrs`/24 on veth ends `devs`; skips the test with
    the reason where namespaces are not permitted; deletes everything afterwards."""
    if shutil.which("ip") is None:
        pytest.skip("no `ip` command (iproute2) on this machine")
    for ns in names:  # leftovers of an interrupted run
        subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=10)
    try:
        _ip("netns", "add", names[0])
    except subprocess.CalledProcessError as e:
        pytest.skip(f"network namespaces not permitted here: {e.stderr.decode().strip()}")
    try:
        _ip("netns", "add", names[1])
        _ip("link", "add", devs[0], "netns", names[0], "type", "veth", "peer", "name", devs[1],
            "netns", names[1])
        for ns, dev, addr in zip(names, devs, addrs, strict=True):
            _ip("-n", ns, "addr", "add", f"{addr}/24", "dev", dev)
            _ip("-n", ns, "link", "set", dev, "up")
            _ip("-n", ns, "link", "set", "lo", "up")
        yield
    finally:
        for ns in names:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=10)


# -- a hub of hosts: every worker its own namespace, joined by a bridge ------------------


def _run(*cmd: str, check: bool = True) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run(list(cmd), check=check, capture_output=True, timeout=10)


class HubUnavailable(RuntimeError):
    """Namespaces, veth or a bridge cannot be made here (the reason is the message)."""


class NetHub:
    """Hosts on one machine: each named host is its own network namespace with one veth
    end (``eth0``-like, ``<prefix>w<i>``) whose other end (``<prefix>h<i>``) is a port of
    a bridge in this (the root) namespace. The bridge holds ``.1`` of the /24, so what runs
    here (the router, the test's clients) reaches every host and every host reaches it;
    hosts reach one another through the bridge. Link faults act on one host's veth pair
    or inside its namespace, and every one of them has an undo.

    ``prefix`` keeps names apart from other tests (at most 5 characters: interface names
    have 15)."""

    def __init__(self, prefix: str, subnet: str, hosts: list[str]) -> None:
        if len(prefix) > 5:
            raise ValueError(f"prefix: at most 5 characters, got {prefix!r}")
        self.prefix = prefix
        base = subnet.rsplit(".", 1)[0]  # "10.77.3.0" -> "10.77.3"
        self.bridge = f"{prefix}br"
        self.hub_addr = f"{base}.1"
        self.ns = {h: f"{prefix}-{h}" for h in hosts}
        self.addr = {h: f"{base}.{10 + i}" for i, h in enumerate(hosts)}
        self.host_dev = {h: f"{prefix}h{i}" for i, h in enumerate(hosts)}
        self.ns_dev = {h: f"{prefix}w{i}" for i, h in enumerate(hosts)}
        self.has_nft = shutil.which("nft") is not None

    # -- making and removing -------------------------------------------------------------

    def up(self) -> None:
        if shutil.which("ip") is None:
            raise HubUnavailable("no `ip` command (iproute2) on this machine")
        self.down()  # leftovers of an interrupted run
        try:
            _run("ip", "link", "add", self.bridge, "type", "bridge")
        except subprocess.CalledProcessError as e:
            raise HubUnavailable(f"cannot make a bridge here: {e.stderr.decode().strip()}") from e
        try:
            _run("ip", "addr", "add", f"{self.hub_addr}/24", "dev", self.bridge)
            _run("ip", "link", "set", self.bridge, "up")
            for h, ns in self.ns.items():
                _run("ip", "netns", "add", ns)
                _run("ip", "link", "add", self.host_dev[h], "type", "veth", "peer", "name",
                     self.ns_dev[h], "netns", ns)
                _run("ip", "link", "set", self.host_dev[h], "master", self.bridge)
                _run("ip", "link", "set", self.host_dev[h], "up")
                _run("ip", "-n", ns, "addr", "add", f"{self.addr[h]}/24", "dev", self.ns_dev[h])
                _run("ip", "-n", ns, "link", "set", self.ns_dev[h], "up")
                _run("ip", "-n", ns, "link", "set", "lo", "up")
        except subprocess.CalledProcessError as e:
            self.down()
            raise HubUnavailable(f"{' '.join(map(str, e.cmd))}: {e.stderr.decode().strip()}") from e

    def down(self) -> None:
        for ns in self.ns.values():
            _run("ip", "netns", "del", ns, check=False)  # takes its veth pair with it
        for dev in self.host_dev.values():
            _run("ip", "link", "del", dev, check=False)
        _run("ip", "link", "del", self.bridge, check=False)

    def exec_prefix(self, host: str) -> list[str]:
        """Prepended to a command to run it on ``host``."""
        return ["ip", "netns", "exec", self.ns[host]]

    # -- link faults (each returns a one-line description; undo_* reverses it) ----------

    def link_down(self, host: str) -> str:
        _run("ip", "link", "set", self.host_dev[host], "down")
        return f"{self.host_dev[host]} down: {host} cut off from every peer and the router"

    def link_up(self, host: str) -> None:
        _run("ip", "link", "set", self.host_dev[host], "up")

    def partition(self, host: str, peer_addrs: list[str]) -> str:
        """Drops everything ``host`` sends to, or receives from, ``peer_addrs`` (nftables);
        where nft is missing, routes to them are refused instead (``ip route prohibit``)."""
        ns = self.ns[host]
        if self.has_nft:
            rules = "\n".join(
                [f"table inet {self.prefix}chaos {{",
                 "  chain out { type filter hook output priority 0; policy accept; "
                 + " ".join(f"ip daddr {a} drop;" for a in peer_addrs) + " }",
                 "  chain in { type filter hook input priority 0; policy accept; "
                 + " ".join(f"ip saddr {a} drop;" for a in peer_addrs) + " }",
                 "}"])
            subprocess.run(["ip", "netns", "exec", ns, "nft", "-f", "-"], input=rules.encode(),
                           check=True, capture_output=True, timeout=10)
            how = "nft drop"
        else:
            for a in peer_addrs:
                _run("ip", "-n", ns, "route", "add", "prohibit", f"{a}/32")
            how = "ip route prohibit"
        return f"{how} in {host} for {', '.join(peer_addrs)}"

    def heal(self, host: str, peer_addrs: list[str]) -> None:
        ns = self.ns[host]
        if self.has_nft:
            _run("ip", "netns", "exec", ns, "nft", "delete", "table", "inet",
                 f"{self.prefix}chaos", check=False)
        else:
            for a in peer_addrs:
                _run("ip", "-n", ns, "route", "del", "prohibit", f"{a}/32", check=False)

    def rate_limit(self, host: str, mbit: float) -> str:
        """A tc token bucket (tbf) on both ends of the host's veth: its traffic, both ways,
        at most ``mbit`` Mbit/s (this kernel has no netem; tbf it has)."""
        spec = ["tbf", "rate", f"{mbit:g}mbit", "burst", "64kb", "latency", "500ms"]
        _run("tc", "qdisc", "replace", "dev", self.host_dev[host], "root", *spec)
        _run("ip", "netns", "exec", self.ns[host], "tc", "qdisc", "replace", "dev",
             self.ns_dev[host], "root", *spec)
        return f"tbf {mbit:g} Mbit/s both ways on {host}'s link"

    def unlimit(self, host: str) -> None:
        _run("tc", "qdisc", "del", "dev", self.host_dev[host], "root", check=False)
        _run("ip", "netns", "exec", self.ns[host], "tc", "qdisc", "del", "dev",
             self.ns_dev[host], "root", check=False)


@contextlib.contextmanager
def hub(prefix: str, subnet: str, hosts: list[str]) -> Iterator[NetHub]:
    """A NetHub for a test: skips it with the reason where namespaces are not permitted."""
    h = NetHub(prefix, subnet, hosts)
    try:
        h.up()
    except HubUnavailable as e:
        pytest.skip(f"network namespaces not permitted here: {e}")
    try:
        yield h
    finally:
        h.down()
