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
