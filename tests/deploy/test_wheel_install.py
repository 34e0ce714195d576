"""The installed product, not the source tree: build the wheel from exactly what
deploy/Containerfile copies into the image, install it non-editable into a fresh venv
outside the checkout, and serve one completion with `pdserve launch` 1P1D at
--tensor-parallel-size 2 (gloo on CPU). A package missing from the wheel (engine.parallel
was once left out of a hand-written list) fails here as an ImportError in a worker.

The venv reuses the project venv's installed dependencies through a .pth line instead of
downloading them: a path in a .pth joins sys.path but the .pth files found there (the
project's editable-install hook among them) do not run, so the source tree stays out of
reach and only the wheel's copy of pdserve imports.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import sysconfig
import venv
from pathlib import Path

import pytest
from cluster_client import generate, stub_for
from pdserve.v1 import router_pb2
from tiny_models import byte_tokenizer, make_tiny_model

from deploy.ports import free_port

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("engine", "engine.models", "engine.parallel", "kernels", "transfer", "producer",
            "consumer", "router", "worker", "deploy", "deploy.benchmark", "deploy.plan",
            "pdserve.v1")


def _containerfile_sources() -> list[str]:
    """The paths deploy/Containerfile COPYs from the build context."""
    text = (ROOT / "deploy" / "Containerfile").read_text()
    out: list[str] = []
    for m in re.finditer(r"^COPY\s+(.+)$", text, re.M):
        out += m.group(1).split()[:-1]  # the last word is the destination
    return out


def _build_wheel(tmp: Path) -> Path:
    ctx = tmp / "context"
    ctx.mkdir()
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    for src in _containerfile_sources():
        s = ROOT / src
        (shutil.copytree(s, ctx / src, ignore=ignore) if s.is_dir() else shutil.copy(s, ctx / src))
    dist = tmp / "dist"
    # --no-build-isolation: setuptools comes from the project venv, no download
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps",
                        "--no-build-isolation", "-w", str(dist), str(ctx)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    (wheel,) = dist.glob("pdserve-*.whl")
    return wheel


def _venv(tmp: Path, wheel: Path) -> Path:
    env_dir = tmp / "venv"
    venv.EnvBuilder(with_pip=False).create(env_dir)
    py = env_dir / "bin" / "python"
    site = subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                          capture_output=True, text=True, check=True).stdout.strip()
    r = subprocess.run([sys.executable, "-m", "pip", "--python", str(py), "install", "-q",
                        "--no-deps", "--no-index", str(wheel)],
                       env=_clean_env(), capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    # after the install: pip would otherwise take the project venv's editable pdserve for
    # this one and install nothing
    Path(site, "project_deps.pth").write_text(sysconfig.get_path("purelib") + "\n")
    return env_dir


def _clean_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
    env["PYTHONNOUSERSITE"] = "1"
    return env


@pytest.mark.slow
def test_wheel_installs_and_serves_tp2(tmp_path: Path) -> None:
    wheel = _build_wheel(tmp_path)
    env_dir = _venv(tmp_path, wheel)
    py, pdserve = env_dir / "bin" / "python", env_dir / "bin" / "pdserve"
    run_dir = tmp_path / "run"  # outside the checkout: nothing imports from the source tree
    run_dir.mkdir()
    env = _clean_env()

    where = subprocess.run(
        [str(py), "-c", "import importlib, sys\n"
         f"for name in {PACKAGES!r}: print(importlib.import_module(name).__file__)"],
        cwd=run_dir, env=env, capture_output=True, text=True, timeout=120)
    assert where.returncode == 0, where.stderr
    files = where.stdout.split()
    assert len(files) == len(PACKAGES)
    assert all(f.startswith(str(env_dir)) for f in files), files

    model = make_tiny_model(str(tmp_path / "model"), "llama", num_key_value_heads=2)
    byte_tokenizer(model)
    port = free_port()
    proc = subprocess.Popen(
        [str(pdserve), "launch", "--model", model, "--grpc-port", str(port),
         "--http-port", "-1", "--threads", "1", "--tensor-parallel-size", "2",
         "--device", "cpu", "--dtype", "float32", "--block-size", "4", "--kv-cache-mib", "4"],
        cwd=run_dir, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    try:
        assert proc.stdout is not None
        while not any(line.startswith("ready") for line in lines):
            line = proc.stdout.readline()
            assert line, "".join(lines)  # launch exited before it was ready
            lines.append(line)
        ch, stub = stub_for(f"127.0.0.1:{port}")
        with ch:
            status = stub.ClusterStatus(router_pb2.ClusterStatusRequest(), timeout=30)
            assert sorted((w.worker_id, w.tp_size) for w in status.workers) == [
                ("worker-0", 2), ("worker-1", 2)], status
            r = generate(stub, dict(max_tokens=6, temperature=0, ignore_eos=True),
                         prompt_token_ids=router_pb2.TokenIds(
                             ids=[5, 17, 33, 90, 12, 7, 8, 3, 100, 200, 44]))
        assert r.error == "", r.error
        assert len(r.token_ids) == 6, r
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=120)
        assert proc.returncode == 0, "".join(lines) + out
    finally:
        if proc.poll() is None:  # a failed assertion: stop the cluster the way Ctrl-C does,
            proc.send_signal(signal.SIGINT)  # so its workers do not outlive the test
            try:
                proc.communicate(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.communicate()
