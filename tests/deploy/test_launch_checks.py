"""`pdserve launch` refuses bad flags before starting anything, with one line naming the
flag; device placement cycles producers, then consumers, then colocated workers."""

from __future__ import annotations

import socket
import time

import pytest

from deploy.cli import main
from deploy.launch_checks import assign_devices, worker_names
from deploy.proc_output import error_line
from deploy.procs import cmdline, processes


def _launch_error(capsys: pytest.CaptureFixture[str], *flags: str) -> str:
    before = {p.pid for p in processes()}
    t0 = time.monotonic()
    assert main(["launch", *flags]) == 2
    assert time.monotonic() - t0 < 10  # refused up front, not after a model load
    err = capsys.readouterr().err
    assert "Traceback" not in err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1, err
    started = [cmdline(p.pid) for p in processes()
               if p.pid not in before and "deploy.cli" in cmdline(p.pid)]
    assert not started, started
    return lines[0]


def test_missing_model_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    line = _launch_error(capsys, "--model", "/nonexistent")
    assert line.startswith("pdserve: error: model: '/nonexistent'")


@pytest.mark.parametrize("flag,value", [("--grpc-port", "99999"), ("--http-port", "70000"),
                                        ("--grpc-port", "-1"), ("--http-port", "-2")])
def test_port_out_of_range_names_the_flag(capsys: pytest.CaptureFixture[str], flag: str,
                                          value: str) -> None:
    line = _launch_error(capsys, flag, value)
    assert line.startswith(f"pdserve: error: {flag[2:]}: {value} is not a port")


def test_port_in_use_names_the_flag(capsys: pytest.CaptureFixture[str]) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        line = _launch_error(capsys, "--grpc-port", str(port))
    assert line.startswith(f"pdserve: error: grpc-port: cannot bind 127.0.0.1:{port}")


def test_same_port_twice(capsys: pytest.CaptureFixture[str]) -> None:
    line = _launch_error(capsys, "--grpc-port", "50999", "--http-port", "50999")
    assert line == "pdserve: error: http-port: 50999 is also the gRPC port"


def test_bad_device_and_threads(capsys: pytest.CaptureFixture[str]) -> None:
    assert _launch_error(capsys, "--devices", "cpu,gpu1") == \
        "pdserve: error: devices: 'gpu1' is not a device (cpu, auto, cuda, cuda:N)"
    assert _launch_error(capsys, "--threads", "-3") == \
        "pdserve: error: threads: must be >= 0, got -3"


def test_bad_worker_counts(capsys: pytest.CaptureFixture[str]) -> None:
    assert _launch_error(capsys, "--producers", "2", "--consumers", "0").startswith(
        "pdserve: error: producers/consumers:")


def test_devices_cycle_producers_then_consumers_then_colocated() -> None:
    got = assign_devices(("cuda:0", "cuda:1", "cuda:2"), 2, 3, 1)
    assert got == {"worker-0": "cuda:0", "worker-1": "cuda:1", "worker-2": "cuda:2",
                   "worker-3": "cuda:0", "worker-4": "cuda:1", "worker-5": "cuda:2"}
    assert assign_devices((), 1, 1, 0) == {}


def test_worker_names_are_role_neutral_and_numbered_in_start_order() -> None:
    """The name is the id at the router, which a role change keeps: no role in it."""
    assert worker_names(2, 1, 1) == [("worker-0", "producer"), ("worker-1", "producer"),
                                     ("worker-2", "consumer"), ("worker-3", "colocated")]
    assert worker_names(0, 0, 2) == [("worker-0", "colocated"), ("worker-1", "colocated")]


def test_error_line_prefers_the_error_over_the_traceback() -> None:
    assert error_line(["usage: pdserve producer [-h]",
                       "pdserve producer: error: unrecognized arguments: --bogus", ""]) == \
        "unrecognized arguments: --bogus"
    tb = ["Traceback (most recent call last):", '  File "x.py", line 1, in <module>',
          "    boom()", "RuntimeError: engine process exited", "  "]
    assert error_line(tb) == "RuntimeError: engine process exited"
    assert error_line([]) == "(no output)"
