"""Thread counts come from the cores a process may use (affinity, cgroup quota), on every
command that runs an engine, and workers of one host split them."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from deploy import cpu_threads
from deploy.cli import build_parser
from deploy.cluster import ClusterSpec, LocalCluster
from deploy.cpu_threads import available_cores, cgroup_cpu_limit, engine_threads
from deploy.worker_cmd import spec_from_args

REPO = Path(__file__).resolve().parents[2]


def _cgroup(tmp_path: Path, files: dict[str, str], proc: str) -> tuple[str, str]:
    root = tmp_path / "cg"
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    root.mkdir(exist_ok=True)
    (tmp_path / "proc_cgroup").write_text(proc)
    return str(root), str(tmp_path / "proc_cgroup")


def test_cgroup_v2_quota_the_smallest_level_wins(tmp_path: Path) -> None:
    root, proc = _cgroup(tmp_path, {"cpu.max": "max 100000",
                                    "pod/cpu.max": "300000 100000",
                                    "pod/ctr/cpu.max": "150000 100000"}, "0::/pod/ctr\n")
    assert cgroup_cpu_limit(root, proc) == 1.5
    assert available_cores(root, proc) == min(2, len(os.sched_getaffinity(0)))


def test_no_quota_means_the_affinity_mask(tmp_path: Path) -> None:
    root, proc = _cgroup(tmp_path, {"cpu.max": "max 100000"}, "0::/\n")
    assert cgroup_cpu_limit(root, proc) is None
    assert available_cores(root, proc) == len(os.sched_getaffinity(0))


def test_cgroup_v1_quota(tmp_path: Path) -> None:
    root, proc = _cgroup(tmp_path, {"cpu,cpuacct/cpu.cfs_quota_us": "50000",
                                    "cpu,cpuacct/cpu.cfs_period_us": "100000"}, "4:cpu:/\n")
    assert cgroup_cpu_limit(root, proc) == 0.5
    assert available_cores(root, proc) == 1  # never 0


def test_engine_threads_split_and_override(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cpu_threads, "available_cores", lambda *a: 8)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert engine_threads(0) == 8
    assert engine_threads(0, share=3) == 2
    assert engine_threads(0, share=16) == 1
    assert engine_threads(5, share=3) == 5  # --threads wins
    monkeypatch.setenv("OMP_NUM_THREADS", "4")  # the operator's word wins over the count
    assert engine_threads(0) == 4 and engine_threads(0, share=2) == 2
    with pytest.raises(ValueError, match="--threads"):
        engine_threads(-1)


def test_launch_splits_the_cores_and_workers_take_theirs(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cpu_threads, "available_cores", lambda *a: 8)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert LocalCluster(ClusterSpec(producers=2, consumers=2)).worker_threads() == 2
    assert LocalCluster(ClusterSpec(producers=1, consumers=1, threads=3)).worker_threads() == 3
    args = build_parser().parse_args(["producer", "--router", "x:1"])
    assert spec_from_args(args, "producer").threads == 8  # never torch's machine-wide default


def test_every_command_that_runs_an_engine_has_threads() -> None:
    parser = build_parser()
    for argv in (["generate", "--prompt", "x"], ["producer", "--router", "x:1"],
                 ["consumer", "--router", "x:1"], ["colocated", "--router", "x:1"],
                 ["launch"], ["plan", "profile", "--out", "p.json"]):
        assert parser.parse_args([*argv, "--threads", "3"]).threads == 3, argv


def test_generate_on_one_allowed_core_uses_one_thread() -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "proto")])}
    env.pop("OMP_NUM_THREADS", None)
    cmd = [sys.executable, "-m", "deploy.cli", "generate", "--prompt", "Hi", "--max-tokens",
           "1", "--json"]
    core = sorted(os.sched_getaffinity(0))[0]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300, cwd=REPO,
                         preexec_fn=lambda: os.sched_setaffinity(0, {core}))
    assert out.returncode == 0, out.stderr[-2000:]
    assert json.loads(out.stdout.splitlines()[-1])["threads"] == 1


def _engine_environ(worker: subprocess.Popen[bytes]) -> dict[str, str]:
    """The environment of the engine process a worker spawned (its multiprocessing child)."""
    end = time.monotonic() + 60
    while time.monotonic() < end:
        assert worker.poll() is None, "the worker exited before spawning its engine"
        try:
            with open(f"/proc/{worker.pid}/task/{worker.pid}/children") as f:
                kids = f.read().split()
            for kid in kids:
                with open(f"/proc/{kid}/cmdline", "rb") as f:
                    if b"spawn_main" not in f.read():
                        continue
                with open(f"/proc/{kid}/environ", "rb") as f:
                    pairs = [kv.split(b"=", 1) for kv in f.read().split(b"\0") if b"=" in kv]
                return {k.decode(): v.decode(errors="replace") for k, v in pairs}
        except OSError:
            pass
        time.sleep(0.05)
    raise AssertionError("no engine process within 60 s")


@pytest.mark.parametrize("given,want", [(None, "PASSIVE"), ("ACTIVE", "ACTIVE")])
def test_a_workers_engine_waits_passively_unless_the_operator_chose(
        given: str | None, want: str) -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "proto")])}
    env.pop("OMP_WAIT_POLICY", None)
    if given is not None:
        env["OMP_WAIT_POLICY"] = given
    # no router there: the engine process starts before the worker registers
    cmd = [sys.executable, "-m", "deploy.cli", "colocated", "--router", "127.0.0.1:9",
           "--threads", "1", "--kv-cache-mib", "16", "--metrics-port", "-1"]
    worker = subprocess.Popen(cmd, env=env, cwd=REPO, stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        assert _engine_environ(worker).get("OMP_WAIT_POLICY") == want
    finally:
        os.killpg(worker.pid, signal.SIGKILL)
        worker.wait(10)


def test_passive_waits_keep_the_operators_policy() -> None:
    env: dict[str, str] = {}
    cpu_threads.passive_omp_waits(env)
    assert env == {"OMP_WAIT_POLICY": "PASSIVE"}
    env = {"OMP_WAIT_POLICY": "ACTIVE"}
    cpu_threads.passive_omp_waits(env)
    assert env == {"OMP_WAIT_POLICY": "ACTIVE"}
