"""`pdserve doctor`: each check's pass and fail (or warn) case, the node checks on this
machine, and the cluster checks against a real launched cluster and a closed port."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest
import torch

from deploy.cli import main
from deploy.cluster import ClusterSpec, LocalCluster
from deploy.doctor import (
    FAIL,
    PASS,
    WARN,
    check_clock,
    check_cuda,
    check_fingerprints,
    check_packages,
    check_port,
    check_thp,
    check_ucx,
    clock_checks,
    cluster_checks,
    exit_code,
    render,
    transport_checks,
)
from deploy.ports import free_port


def test_packages_pass_and_a_missing_one_fails() -> None:
    ok = check_packages(("torch", "grpcio"), {})
    assert [c.status for c in ok] == [PASS] and ok[0].detail.startswith("torch 2.")
    bad = check_packages(("torch", "pdserve-no-such-package"), {"also-not-there": "X"})
    assert bad[0].status == FAIL and bad[0].detail == "missing: pdserve-no-such-package"
    assert bad[1].status == WARN and bad[1].detail == "not installed (X unavailable)"
    assert exit_code(bad) == 1 and exit_code(ok) == 0


def test_thp_modes(tmp_path: Path) -> None:
    f = tmp_path / "enabled"
    f.write_text("always [madvise] never\n")
    assert check_thp(str(f)).status == PASS and check_thp(str(f)).detail == "madvise"
    f.write_text("always madvise [never]\n")
    assert check_thp(str(f)).status == WARN
    assert check_thp(str(tmp_path / "missing")).status == WARN


def test_ucx_transports() -> None:
    real = {c.name: c for c in check_ucx()}
    assert real["ucx transports"].status == PASS and "tcp" in real["ucx transports"].detail
    assert [c.status for c in transport_checks({"tcp", "rc_mlx5"})] == [PASS, PASS]
    assert [c.status for c in transport_checks({"tcp", "posix"})] == [PASS, WARN]
    assert transport_checks(set())[0].status == FAIL


def test_cuda_check_matches_the_machine() -> None:
    first = check_cuda()[0]
    assert first.status == (PASS if torch.cuda.is_available() else WARN), first


def test_port_open_and_closed() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        assert check_port("p", f"127.0.0.1:{s.getsockname()[1]}").status == PASS
    closed = check_port("p", f"127.0.0.1:{free_port()}")
    assert closed.status == FAIL and "unreachable" in closed.detail


def test_router_down_fails_with_exit_1(capsys: pytest.CaptureFixture[str]) -> None:
    port = free_port()
    assert main(["doctor", "--skip-node", "--router", f"127.0.0.1:{port}"]) == 1
    out = capsys.readouterr().out
    assert out.splitlines()[0].split() == ["check", "status", "detail"]
    assert f"router  FAIL    cannot reach the router at 127.0.0.1:{port}: " in out


def test_a_running_cluster_passes() -> None:
    with LocalCluster(ClusterSpec(producers=1, consumers=1, threads=1, http_port=0,
                                  worker_args=("--kv-cache-mib", "64"))) as c:
        checks = cluster_checks(c.router_address)
        by = {k.name: k for k in checks}
        assert all(k.status == PASS for k in checks), render(checks)
        assert by["kv fingerprints"].detail.endswith("on 2 worker(s)")
        assert by["versions"].status == PASS
        assert by["consumer worker-1 KV port"].status == PASS  # the UCX handshake port
        clock = clock_checks(f"http://127.0.0.1:{c.http_port}")
        assert [k.status for k in clock] == [PASS], render(clock)
        assert by["roles"].detail == "consumer, producer"
        assert by["producer worker-0 gRPC port"].status == PASS
        assert by["consumer worker-1 gRPC port"].status == PASS
        assert by["consumer worker-1 Outputs port"].status == PASS  # --outputs-port 0
        c.kill("worker-1")
        # while the router still lists it, its gRPC port is closed; once dropped, the
        # cluster has no consumer: either way doctor fails and names it
        after = cluster_checks(c.router_address)
        failed = [k for k in after if k.status == FAIL]
        assert exit_code(after) == 1, render(after)
        assert {k.name for k in failed} <= {"roles", "consumer worker-1",
                                             "consumer worker-1 gRPC port",
                                             "consumer worker-1 KV port",
                                             "consumer worker-1 Outputs port"}, render(after)


def test_fingerprints_match_and_a_mismatch_fails() -> None:
    ok = check_fingerprints([("p0", "producer", "c8ea"), ("c0", "consumer", "c8ea"),
                             ("x0", "colocated", "c8ea")])
    assert ok.status == PASS and ok.detail == "c8ea on 3 worker(s)"
    bad = check_fingerprints([("p0", "producer", "c8ea"), ("c0", "consumer", "d00d"),
                              ("c1", "consumer", "c8ea")])
    assert bad.status == FAIL and bad.detail == "2 KV layouts: c8ea: p0 c1, d00d: c0"
    # a colocated worker may be made a producer or consumer by a role change: it counts
    assert check_fingerprints([("p0", "producer", "a"), ("c0", "consumer", "a"),
                               ("x0", "colocated", "b")]).status == FAIL
    assert check_fingerprints([]).status == WARN


def test_clock_skew() -> None:
    date = "Mon, 30 Nov 2026 19:00:00 GMT"
    t = 1796065200.0  # that moment
    assert check_clock(date, t).status == PASS
    assert check_clock(date, t - 5).status == WARN
    bad = check_clock(date, t + 120)
    assert bad.status == FAIL and bad.detail == "-120.0 s against the router"
