"""A router with no workers, started as an operator starts one (``python -m deploy.cli
router``), for tests of what a process does around its loop: the stall recorder, and the
bench probes that hook the loop through ``sitecustomize``."""

from __future__ import annotations

import signal
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from deploy.ports import free_port


@contextmanager
def bare_router(env: dict[str, str]) -> Iterator[tuple[subprocess.Popen[str], list[str]]]:
    """Yields the process and its output up to the line that says it serves (its stdout stays
    open for more); then stops it with SIGTERM and checks it exits 0, or kills it if the
    test failed first."""
    p = subprocess.Popen([sys.executable, "-m", "deploy.cli", "router", "--host", "127.0.0.1",
                          "--grpc-port", str(free_port("127.0.0.1"))], env=env,
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        assert p.stdout is not None
        lines: list[str] = []
        for line in p.stdout:
            lines.append(line)
            if line.startswith("pdserve router: gRPC"):
                break
        else:
            pytest.fail(f"the router did not start: {p.wait(10)} {lines}")
        yield p, lines
        p.send_signal(signal.SIGTERM)
        assert p.wait(30) == 0
    finally:
        if p.poll() is None:
            p.kill()
            p.wait(10)
