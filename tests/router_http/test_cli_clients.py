"""Every command that talks to a router takes --api-key (and $PDSERVE_API_KEY), and a router
that refuses or cannot be reached is one line on stderr, never a gRPC traceback. Against a
real router on fake workers (threaded_router); the live-cluster run is in
tests/e2e/test_http_api.py."""

from __future__ import annotations

import json
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest
from threaded_router import ThreadedRouter

from deploy.cli import main

KEY = "cli-test-key"
BENCH = ["bench", "--num-prompts", "2", "--warmup", "0", "--input-len", "8",
         "--output-len", "3"]


@pytest.fixture(scope="module")
def router() -> Iterator[ThreadedRouter]:
    r = ThreadedRouter(api_key=KEY)
    r.start()
    yield r
    r.stop()


def _dead_address() -> str:
    with socket.socket() as s:  # a port nothing listens on (closed again at once)
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


def _one_line(capsys: pytest.CaptureFixture[str]) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    err = [line for line in err if not line.startswith(("I0", "W0", "E0"))]  # grpc core's log
    assert len(err) == 1, err
    assert "Traceback" not in err[0]
    return err[0]


def test_bench_with_the_key_flag_and_variable(router: ThreadedRouter, tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    out = tmp_path / "r.json"
    assert main([*BENCH, "--router", router.grpc_address, "--api-key", KEY,
                 "--result-json", str(out)]) == 0
    doc = out.read_text()
    assert KEY not in doc  # the result file is shareable: no key in it
    assert json.loads(doc)["configs"][0]["points"][0]["metrics"]["failed"] == 0
    monkeypatch.setenv("PDSERVE_API_KEY", KEY)
    assert main([*BENCH, "--router", router.grpc_address]) == 0
    assert main([*BENCH, "--backend", "openai", "--router", router.grpc_address,
                 "--base-url", f"http://127.0.0.1:{router.port}"]) == 0


@pytest.mark.parametrize("backend", ["grpc", "openai"])
def test_bench_refused_is_one_line(router: ThreadedRouter, backend: str,
                                   capsys: pytest.CaptureFixture[str]) -> None:
    rc = main([*BENCH, "--backend", backend, "--router", router.grpc_address,
               "--base-url", f"http://127.0.0.1:{router.port}", "--api-key", "wrong"])
    assert rc == 1
    line = _one_line(capsys)
    assert line.startswith("pdserve: error: the router at ") and "--api-key" in line


def test_unreachable_router_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    dead = _dead_address()
    assert main([*BENCH, "--router", dead]) == 1
    assert f"cannot reach the router at {dead}" in _one_line(capsys)
    assert main(["plan", "apply", "--router", dead, "--producers", "1",
                 "--consumers", "1"]) == 1
    assert f"cannot reach the router at {dead}" in _one_line(capsys)


def test_plan_apply_and_doctor_take_the_key(router: ThreadedRouter,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    # a wrong key: refused, one line naming the flag
    assert main(["plan", "apply", "--router", router.grpc_address, "--producers", "1",
                 "--consumers", "1", "--api-key", "wrong"]) == 1
    assert "--api-key" in _one_line(capsys)
    main(["doctor", "--skip-node", "--router", router.grpc_address, "--api-key", KEY])
    out = capsys.readouterr().out
    assert "router" in out and "policy" in out  # ClusterStatus answered: the key was sent


def test_the_slurm_job_waits_on_a_keyed_router(router: ThreadedRouter,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """The SLURM driver's readiness poll sends the key its router step was given."""
    from deploy.slurm_job import _healthy

    monkeypatch.setenv("PDSERVE_API_KEY", KEY)
    up = _healthy(router.grpc_address)
    assert len(up["producer"]) == 1 and len(up["consumer"]) == 1


def test_the_slurm_job_stops_workers_before_the_router() -> None:
    from deploy.slurm_job import stop_steps

    order: list[str] = []

    class Step:
        def __init__(self, name: str) -> None:
            self.name, self.done = name, False

        def poll(self) -> int | None:
            return 0 if self.done else None

        def send_signal(self, sig: int) -> None:
            order.append(f"TERM {self.name}")

        def wait(self, timeout: float) -> int:
            order.append(f"exited {self.name}")
            self.done = True
            return 0

    stop_steps({"router": Step("router"), "worker-a2-0": Step("worker-a2-0"),
                "worker-a3-0": Step("worker-a3-0")})
    assert order[-2:] == ["TERM router", "exited router"]
    assert set(order[:4]) == {"TERM worker-a2-0", "TERM worker-a3-0",
                              "exited worker-a2-0", "exited worker-a3-0"}
