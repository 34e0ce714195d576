"""1P1D across two network namespaces joined by a veth pair: each role started by its own
command with its own addresses, KV over UCX on TCP (shared memory would cross namespaces)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import netns_hosts
import pytest

from engine.sampling_params import SamplingParams

NS = ("pdn_a", "pdn_b")
ADDR = ("10.201.9.1", "10.201.9.2")
PORT = 47311
QUESTIONS = ["What is the capital of France?", "List three colors."]


@pytest.fixture
def two_hosts():  # type: ignore[no-untyped-def]
    with netns_hosts.two_hosts(NS, ADDR, ("pdn_va", "pdn_vb")):
        yield


def _start(ns: str, log, *args: str) -> subprocess.Popen[bytes]:  # type: ignore[no-untyped-def]
    env = {**os.environ, "UCX_TLS": "tcp", "UCX_NET_DEVICES": "all"}
    return subprocess.Popen(["ip", "netns", "exec", ns, sys.executable, "-m", "deploy.cli",
                             *args], env=env, stdout=log, stderr=log, start_new_session=True)


def test_1p1d_across_namespaces(two_hosts, tmp_path, colocated_llm):
    router = f"{ADDR[0]}:{PORT}"
    logs = {n: open(tmp_path / f"{n}.log", "wb") for n in ("router", "producer", "consumer")}
    procs = [
        # the P/D path only: no consumer prefills a short uncached tail itself
        _start(NS[0], logs["router"], "router", "--host", ADDR[0], "--grpc-port", str(PORT),
               "--local-prefill-max-tokens", "-1"),
        _start(NS[0], logs["producer"], "producer", "--router", router, "--host", ADDR[0],
               "--threads", "1", "--max-num-batched-tokens", "64"),
        _start(NS[1], logs["consumer"], "consumer", "--router", router, "--host", ADDR[1],
               "--kv-host", ADDR[1], "--threads", "1"),
    ]
    try:
        client = [ "ip", "netns", "exec", NS[0], sys.executable,
                  os.path.join(os.path.dirname(__file__), "netns_client.py"), router, "16",
                  json.dumps(QUESTIONS)]
        env = {**os.environ, "PYTHONPATH": os.path.dirname(os.path.dirname(__file__))}
        out = None
        end = time.monotonic() + 180
        while time.monotonic() < end:  # until both workers registered and a request works
            p = subprocess.run(client, capture_output=True, text=True, timeout=180, env=env)
            if p.returncode == 0:
                res = json.loads(p.stdout.strip().splitlines()[-1])
                if all(r["error"] == "" for r in res):
                    out = res
                    break
            time.sleep(1.0)
        assert out is not None, (tmp_path / "consumer.log").read_text()[-2000:]
        ref = colocated_llm.generate(QUESTIONS, SamplingParams(max_tokens=16, temperature=0),
                                     chat=True)
        for r, c in zip(out, ref, strict=True):
            assert r["ids"] == c.token_ids
            assert r["producer"] and r["consumer"]  # served disaggregated, across the veth
        consumer_log = (tmp_path / "consumer.log").read_text()
        assert ADDR[1] in consumer_log  # the consumer's KV receiver advertised its own host
    finally:
        for p_ in procs:
            if p_.poll() is None:
                os.killpg(p_.pid, signal.SIGTERM)
        for p_ in procs:
            try:
                p_.wait(15)
            except subprocess.TimeoutExpired:
                os.killpg(p_.pid, signal.SIGKILL)
        for f in logs.values():
            f.close()
