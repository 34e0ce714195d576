"""A launched cluster, as its user runs it: each cluster gets its own random token, workers
get their --device, a worker killed with SIGKILL is restarted and serves again, and a
process that dies during start-up is reported in one line without a traceback."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time

from cluster_client import chat, generate, stub_for

from deploy.ports import free_port
from deploy.procs import cmdline, processes


def _start(*flags: str) -> tuple[subprocess.Popen[str], list[str]]:
    env = {**os.environ}
    env.pop("PDSERVE_CLUSTER_TOKEN", None)
    proc = subprocess.Popen([sys.executable, "-m", "deploy.cli", "launch", "--threads", "1",
                             *flags], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env=env)
    return proc, []


def _read_until(proc: subprocess.Popen[str], lines: list[str], prefix: str,
                deadline_s: float) -> None:
    end = time.monotonic() + deadline_s
    assert proc.stdout is not None
    while not any(ln.startswith(prefix) for ln in lines):
        line = proc.stdout.readline()
        assert line or proc.poll() is None, "launch exited:\n" + "".join(lines)
        lines.append(line)
        assert time.monotonic() < end, f"no {prefix!r} line in time:\n" + "".join(lines)


def _children(pid: int) -> dict[str, int]:
    """Worker/router name -> pid of the launcher's direct children."""
    out = {}
    for p in processes():
        if p.ppid == pid and p.state != "Z":
            argv = cmdline(p.pid).split()
            if "--worker-id" in argv:
                out[argv[argv.index("--worker-id") + 1]] = p.pid
            elif "router" in argv:
                out["router"] = p.pid
    return out


def _environ(pid: int) -> dict[str, str]:
    with open(f"/proc/{pid}/environ", "rb") as f:
        pairs = [kv.split(b"=", 1) for kv in f.read().split(b"\0") if b"=" in kv]
    return {k.decode(): v.decode(errors="replace") for k, v in pairs}


def test_launch_restarts_a_killed_worker_and_serves_again() -> None:
    port = free_port()
    proc, lines = _start("--grpc-port", str(port), "--http-port", "-1", "--devices", "cpu")
    try:
        _read_until(proc, lines, "ready", 300)
        kids = _children(proc.pid)
        assert set(kids) == {"router", "worker-0", "worker-1"}, kids
        # its own random token, in every process's environment (never on a command line)
        tokens = {n: _environ(pid).get("PDSERVE_CLUSTER_TOKEN", "") for n, pid in kids.items()}
        assert len(set(tokens.values())) == 1 and len(tokens["router"]) >= 32, tokens
        assert all(tokens["router"] not in cmdline(pid) for pid in kids.values())
        for name in ("worker-0", "worker-1"):
            argv = cmdline(kids[name]).split()
            assert argv[argv.index("--device") + 1] == "cpu", argv
            assert _environ(kids[name])["UCX_WARN_UNUSED_ENV_VARS"] == "n"

        os.kill(kids["worker-1"], signal.SIGKILL)
        _read_until(proc, lines, "worker-1 restarted", 60)
        text = "".join(lines)
        assert "worker-1 exited (killed by signal 9)" in text, text
        assert proc.poll() is None, text

        new = _children(proc.pid)
        assert new["worker-1"] != kids["worker-1"] and new["worker-0"] == kids["worker-0"]
        ch, stub = stub_for(f"127.0.0.1:{port}")
        end = time.monotonic() + 240
        with ch:
            while True:  # until the new consumer has loaded its model and re-registered
                r = generate(stub, dict(max_tokens=8, temperature=0),
                             **chat("What is the capital of France?"))
                if "Paris" in r.text or time.monotonic() > end:
                    break
                time.sleep(0.2)  # a refusal is answered at once; the worker is ready any time
        assert r.error == "" and "Paris" in r.text, (r, "".join(lines))
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)


def test_a_worker_dying_during_start_up_is_one_line() -> None:
    proc, _ = _start("--grpc-port", "0", "--http-port", "-1", "--worker-arg=--bogus")
    out, _ = proc.communicate(timeout=240)
    assert proc.returncode == 1, out
    assert "Traceback" not in out, out
    errors = [ln for ln in out.splitlines() if "error" in ln]
    # both workers reject the flag; whichever the launcher saw die first is named
    assert len(errors) == 1 and re.fullmatch(
        r"pdserve: error: during start-up, worker-[01] exited \(exit 2\): "
        r"unrecognized arguments: --bogus", errors[0]), out
