"""CPU a writer spends per message on a loopback TCP socket against a Unix socket.

The consumer's Outputs port writes one frame per engine step to the router over TCP
(worker/outputs_port.py). On one host, the kernel's loopback TCP path runs much of the
receiver's work inside the sender's send(). This probe prices one spaced-out write each
way: a child process reads, and the parent sends ``--size`` bytes every ``--gap-ms``,
timing its own CPU (CLOCK_PROCESS_CPUTIME_ID) around each send. Linux only (abstract Unix
socket names).

    python bench/probes/uds_write_probe.py [--writes 200 --gap-ms 50 --size 3000]
"""

from __future__ import annotations

import argparse
import os
import socket
import time


def cpu_per_write(kind: str, writes: int, gap_s: float, size: int) -> float:
    """µs of this process's CPU per send of `size` bytes, one every gap_s."""
    srv = socket.socket(socket.AF_INET if kind == "tcp" else socket.AF_UNIX)
    if kind == "tcp":
        srv.bind(("127.0.0.1", 0))
    else:
        srv.bind(f"\0pdserve-uds-probe-{os.getpid()}")
    srv.listen(1)
    addr = srv.getsockname()
    pid = os.fork()
    if pid == 0:  # the reader: takes everything, then exits
        c = socket.socket(srv.family)
        c.connect(addr)
        got = 0
        while got < writes * size:
            data = c.recv(1 << 16)
            if not data:
                break
            got += len(data)
        os._exit(0)
    conn, _ = srv.accept()
    if kind == "tcp":
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # as asyncio sets it
    msg = b"x" * size
    cpu = 0.0
    for _ in range(writes):
        time.sleep(gap_s)
        t0 = time.process_time()
        conn.sendall(msg)
        cpu += time.process_time() - t0
    os.waitpid(pid, 0)
    conn.close()
    srv.close()
    return cpu / writes * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--writes", type=int, default=200)
    ap.add_argument("--gap-ms", type=float, default=50.0)
    ap.add_argument("--size", type=int, default=3000)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    for _ in range(args.rounds):
        for kind in ("tcp", "unix"):
            us = cpu_per_write(kind, args.writes, args.gap_ms / 1000, args.size)
            print(f"{kind}: {us:.1f} us of the writer's CPU per write", flush=True)


if __name__ == "__main__":
    main()
