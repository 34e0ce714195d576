"""Free ports the launcher picks for its children before they bind them.

A port found free by binding port 0 comes from the kernel's ephemeral range, the same range
every outgoing connection (gRPC, UCX, ZMQ) takes its local port from. Between the pick and
the child's bind, such a connection can take it, and the child then fails at start-up with
"address already in use" (seen in CI). Ports are therefore drawn from outside that range,
where the kernel never assigns one by itself, and checked free as a server would bind them.
"""

from __future__ import annotations

import random
import socket
import threading

# Where no range can be read (not Linux): the IANA dynamic range, Linux's default.
_DEFAULT_EPHEMERAL = (32768, 60999)
_LOWEST = 10000  # below: well-known and registered service ports, more often taken
_issued: set[int] = set()  # not handed out twice by this process (children bind later)
_lock = threading.Lock()


def ephemeral_range(path: str = "/proc/sys/net/ipv4/ip_local_port_range") -> tuple[int, int]:
    try:
        with open(path) as f:
            lo, hi = (int(x) for x in f.read().split())
        return lo, hi
    except (OSError, ValueError):
        return _DEFAULT_EPHEMERAL


def pick_range(ephemeral: tuple[int, int]) -> range:
    """The larger span of ports outside ``ephemeral`` and above _LOWEST; empty if none."""
    lo, hi = ephemeral
    below = range(_LOWEST, max(_LOWEST, lo))
    above = range(min(65536, hi + 1), 65536)
    return max(below, above, key=len)


def bind_error(host: str, port: int) -> str | None:
    """Why a server could not bind ``host:port`` now (None: it could)."""
    with socket.socket() as s:
        # as a server binds it: a port in TIME_WAIT is free, a bound or listening one is not
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as e:
            return e.strerror or str(e)
        return None


def _kernel_pick(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def free_port(host: str = "127.0.0.1") -> int:
    """A port free on ``host`` now, outside the ephemeral range, not issued before here."""
    return free_run(1, host)


def free_run(n: int, host: str = "127.0.0.1") -> int:
    """The first of ``n`` consecutive such ports (SLURM's slurmd wants a run of them)."""
    span = pick_range(ephemeral_range())
    # an ephemeral range over almost every port leaves no room to draw from
    tries = 500 if len(span) >= n + 64 else 0
    with _lock:
        for _ in range(tries):
            base = random.randrange(span.start, span.stop - n + 1)
            ports = range(base, base + n)
            if any(p in _issued for p in ports):
                continue
            if all(bind_error(host, p) is None for p in ports):
                _issued.update(ports)
                return base
        if n == 1:  # nothing outside the range: the kernel's pick, racy as it is
            for _ in range(100):
                port = _kernel_pick(host)
                if port not in _issued:
                    _issued.add(port)
                    return port
    raise RuntimeError(f"no run of {n} free ports on {host} outside the ephemeral range")
