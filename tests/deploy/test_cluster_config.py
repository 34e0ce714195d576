"""`pdserve launch --config cluster.yaml`: the file describes the cluster; unknown keys and
bad values are errors naming the key, before anything starts."""

from __future__ import annotations

import argparse
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from cluster_client import chat, generate, stub_for

from deploy.cli import build_parser, main
from deploy.cluster_config import apply_config, parse_cluster_config
from deploy.ports import free_port
from deploy.procs import cmdline, processes


def _err(doc: object) -> str:
    with pytest.raises(ValueError) as e:
        parse_cluster_config(doc)
    return str(e.value)


def test_full_file_maps_to_launch_flags() -> None:
    cfg = parse_cluster_config({
        "model": "smollm2", "host": "127.0.0.1",
        "workers": {"producers": 2, "consumers": 3, "colocated": 1},
        "devices": ["cuda:0", "cuda:1"], "ports": {"grpc": 50100, "http": -1},
        "policy": "least_loaded", "transfer_backend": "ipc", "threads": 2,
        "engine": {"max-num-seqs": 8, "kv_cache_mib": 128}, "worker_args": ["--lease=5"],
        "log_dir": "/tmp/x"})
    assert cfg.values == {
        "model": "smollm2", "host": "127.0.0.1", "producers": 2, "consumers": 3,
        "colocated": 1, "devices": "cuda:0,cuda:1", "grpc_port": 50100, "http_port": -1,
        "policy": "least_loaded", "transfer_backend": "ipc", "threads": 2,
        "worker_arg": ["--max-num-seqs=8", "--kv-cache-mib=128", "--lease=5"],
        "log_dir": "/tmp/x"}


@pytest.mark.parametrize("doc,msg", [
    ({"modle": "x"}, "(top level).modle: unknown key"),
    ({"workers": {"prefillers": 1}}, "workers.prefillers: unknown key"),
    ({"workers": {"producers": -1}}, "workers.producers: expected an integer in 0..1024"),
    ({"workers": {"producers": "two"}}, "workers.producers: expected an integer"),
    ({"ports": {"grpc": 99999}}, "ports.grpc: expected an integer in 0..65535"),
    ({"ports": {"metrics": 1}}, "ports.metrics: unknown key"),
    ({"policy": "random"}, "policy: 'random' is not one of"),
    ({"transfer_backend": "tcp"}, "transfer_backend: 'tcp' is not one of"),
    ({"engine": {"max-num-seq": 8}}, "engine.max-num-seq: unknown engine flag"),
    ({"engine": {"max-num-seqs": "lots"}}, "engine.max-num-seqs: argument --max-num-seqs"),
    ({"engine": {"dtype": "float7"}}, "engine.dtype: argument --dtype: invalid choice"),
    ({"engine": {"device": "cuda"}}, "engine.device: set it with the top-level devices key"),
    ({"devices": 3}, "devices: expected a list"),
    ({"worker_args": "--x"}, "worker_args: expected a list of strings"),
    (["model"], "(top level): expected a mapping"),
])
def test_bad_keys_and_values_name_the_key(doc: object, msg: str) -> None:
    assert _err(doc).startswith(msg)


def _launch_args(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(["launch", *argv])


def test_command_line_flags_win_over_the_file() -> None:
    args = _launch_args("--producers", "3", "--worker-arg=--lease=9")
    cfg = parse_cluster_config({"workers": {"producers": 2, "consumers": 2},
                                "engine": {"max-num-seqs": 4}})
    apply_config(args, args.launch_defaults, cfg)
    assert (args.producers, args.consumers) == (3, 2)
    assert args.worker_arg == ["--max-num-seqs=4", "--lease=9"]


def test_bad_file_is_one_error_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    f = tmp_path / "cluster.yaml"
    f.write_text("workers:\n  producers: 1\n  consumers: 1\nports:\n  grpc: 70000\n")
    assert main(["launch", "--config", str(f)]) == 2
    assert capsys.readouterr().err == \
        "pdserve: error: ports.grpc: expected an integer in 0..65535, got 70000\n"
    assert main(["launch", "--config", str(tmp_path / "missing.yaml")]) == 2
    assert "config: cannot read" in capsys.readouterr().err
    f.write_text("workers: [\n")
    assert main(["launch", "--config", str(f)]) == 2
    assert "is not YAML" in capsys.readouterr().err


def test_launch_from_a_config_file(tmp_path: Path) -> None:
    port = free_port()
    f = tmp_path / "cluster.yaml"
    f.write_text(f"workers: {{producers: 0, consumers: 0, colocated: 1}}\n"
                 f"devices: [cpu]\nports: {{grpc: {port}, http: -1}}\nthreads: 1\n"
                 f"policy: least_loaded\nengine: {{max-num-seqs: 4, kv-cache-mib: 64}}\n")
    proc = subprocess.Popen([sys.executable, "-m", "deploy.cli", "launch", "--config", str(f)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    try:
        end = time.monotonic() + 240
        assert proc.stdout is not None
        while not any(ln.startswith("ready") for ln in lines):
            line = proc.stdout.readline()
            assert line or proc.poll() is None, "".join(lines)
            lines.append(line)
            assert time.monotonic() < end, "".join(lines)
        argv = [cmdline(p.pid).split() for p in processes() if p.ppid == proc.pid]
        worker = [a for a in argv if "colocated" in a]
        router = [a for a in argv if "router" in a]
        assert len(worker) == 1 and len(router) == 1, argv
        assert worker[0][worker[0].index("--device") + 1] == "cpu"
        assert "--max-num-seqs=4" in worker[0] and "--kv-cache-mib=64" in worker[0]
        assert router[0][router[0].index("--policy") + 1] == "least_loaded"
        ch, stub = stub_for(f"127.0.0.1:{port}")
        with ch:
            r = generate(stub, dict(max_tokens=8, temperature=0),
                         **chat("What is the capital of France?"))
        assert r.error == "" and "Paris" in r.text, r
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)
