"""A mirror frontend's life beside its primary (`pdserve router --frontends N`,
deploy/router_cmd.py): real router processes, no workers. A mirror arranges to end with the
primary itself (it is started with no Python between fork and exec), so killing the primary
outright ends the mirror; a mirror whose primary is already gone when it starts exits at
once, saying so."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from deploy.ports import free_port

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="PR_SET_PDEATHSIG is Linux's")


def _children(pid: int) -> list[int]:
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        return [int(p) for p in f.read().split()]


def _alive(pid: int) -> bool:
    """Running (not gone, not a zombie waiting to be reaped)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_a_mirror_ends_when_its_primary_is_killed() -> None:
    port = free_port("127.0.0.1")
    primary = subprocess.Popen([sys.executable, "-m", "deploy.cli", "router", "--host",
                                "127.0.0.1", "--grpc-port", str(port), "--frontends", "2"],
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    mirrors: list[int] = []
    try:
        end = time.monotonic() + 60
        while not mirrors:
            assert primary.poll() is None, primary.communicate()[0].decode(errors="replace")
            assert time.monotonic() < end, "the primary started no mirror"
            mirrors = [k for k in _children(primary.pid)
                       if b"--primary-pid" in open(f"/proc/{k}/cmdline", "rb").read()]
            time.sleep(0.2)
        (mirror,) = mirrors
        time.sleep(2)  # past its start-up: its own death signal is set by now
        assert _alive(mirror), "the mirror exited on its own"
        primary.send_signal(signal.SIGKILL)
        primary.wait(10)
        end = time.monotonic() + 15
        while _alive(mirror):
            assert time.monotonic() < end, "the mirror outlived its primary"
            time.sleep(0.1)
    finally:
        if primary.poll() is None:
            primary.kill()
            primary.wait(10)
        for k in [k for k in mirrors if _alive(k)]:
            os.kill(k, signal.SIGKILL)


def test_a_mirror_whose_primary_is_gone_exits_at_once() -> None:
    # its parent (this test) is not the primary it names: the primary died before the
    # mirror could arrange to die with it
    r = subprocess.run([sys.executable, "-m", "deploy.cli", "router", "--host", "127.0.0.1",
                        "--grpc-port", str(free_port("127.0.0.1")), "--primary",
                        "127.0.0.1:1", "--primary-pid", str(os.getpid() + 1_000_000)],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 1, (r.returncode, r.stdout, r.stderr)
    assert "the primary router" in r.stderr and "is gone" in r.stderr, r.stderr
