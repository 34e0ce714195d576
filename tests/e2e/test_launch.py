"""`pdserve launch` (the README's main command): prints its endpoints, serves, and on Ctrl-C
(SIGINT; SIGTERM takes the same path) stops every process it started, workers (drained)
before the router, saying nothing alarming."""

from __future__ import annotations

import ipaddress
import os
import re
import signal
import subprocess
import sys
import time

from cluster_client import chat, generate, stub_for

from deploy.ports import free_port


def _children(pid: int) -> set[int]:
    out = subprocess.run(["ps", "-e", "-o", "pid=,ppid="], capture_output=True, text=True).stdout
    parents: dict[int, list[int]] = {}
    for line in out.splitlines():
        p, pp = map(int, line.split())
        parents.setdefault(pp, []).append(p)
    found, todo = set(), [pid]
    while todo:
        for c in parents.get(todo.pop(), []):
            found.add(c)
            todo.append(c)
    return found


def _listening(pids: set[int]) -> set[tuple[str, int]]:
    """(address, port) of every TCP socket in LISTEN state that one of ``pids`` holds."""
    inodes = set()
    for pid in pids:
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if target.startswith("socket:["):
                inodes.add(target[8:-1])
    found = set()
    for path, size in (("/proc/net/tcp", 4), ("/proc/net/tcp6", 16)):
        with open(path) as f:
            for line in f.readlines()[1:]:
                cols = line.split()
                if cols[3] != "0A" or cols[9] not in inodes:  # 0A: TCP_LISTEN
                    continue
                hexaddr, hexport = cols[1].split(":")
                raw = bytes.fromhex(hexaddr)
                # /proc prints each 32-bit word in host (little-endian) order
                raw = b"".join(raw[i:i + 4][::-1] for i in range(0, size, 4))
                ip = ipaddress.ip_address(raw)
                if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
                    ip = ip.ipv4_mapped  # a v6 socket bound to ::ffff:127.0.0.1
                found.add((str(ip), int(hexport, 16)))
    return found


ALARMING = re.compile(r"error|traceback|warn|could not|fail|dropped|killed|exception", re.I)


def test_launch_serves_and_stops_everything_on_ctrl_c():
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "deploy.cli", "launch", "--grpc-port",
                             str(port), "--http-port", "-1", "--threads", "1"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    try:
        end = time.monotonic() + 240
        assert proc.stdout is not None
        while not any(line.startswith("ready") for line in lines):
            line = proc.stdout.readline()
            assert line or proc.poll() is None, "".join(lines)
            lines.append(line)
            assert time.monotonic() < end, "".join(lines)
        text = "".join(lines)
        assert f"router gRPC:  127.0.0.1:{port}" in text
        assert re.search(r"producer\s+worker-0", text) and re.search(r"consumer\s+worker-1",
                                                                       text)
        ch, stub = stub_for(f"127.0.0.1:{port}")
        with ch:
            r = generate(stub, dict(max_tokens=8, temperature=0),
                         **chat("What is the capital of France?"))
        assert r.error == "" and "Paris" in r.text
        kids = _children(proc.pid)
        assert len(kids) >= 5  # router, 2 worker gRPC processes, 2 engine processes
        # --host 127.0.0.1 (the default): nothing listens anywhere else, UCX included
        listening = _listening(kids)
        assert len(listening) >= 6, listening  # router, 2 x (gRPC, metrics), KV control
        assert {a for a, _ in listening} <= {"127.0.0.1", "::1"}, listening
        proc.send_signal(signal.SIGINT)  # what Ctrl-C sends the launcher
        out, _ = proc.communicate(timeout=60)
        assert proc.returncode == 0, out
        # workers drain and deregister while the router still runs, then the router stops
        assert not ALARMING.search(out), out
        assert out.index("worker-0 left") < out.index("router: shutting down"), out
        assert out.index("worker-1 left") < out.index("router: shutting down"), out
        time.sleep(0.5)
        alive = [k for k in kids if os.path.exists(f"/proc/{k}")
                 and "zombie" not in open(f"/proc/{k}/status").read().lower()]
        assert not alive, alive
    finally:
        if proc.poll() is None:
            proc.kill()
