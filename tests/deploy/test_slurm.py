"""deploy/slurm/pdserve.sbatch on a real SLURM (slurmctld + three slurmd as nodes n[1-3] on
this host): a 3-node 1P1D job on SmolLM2 over UCX writes its endpoint file, serves a
streamed chat completion with the colocated engine's tokens, and scancel leaves no process."""

from __future__ import annotations

import json
import os
import sys
import time
import urllib.request
from pathlib import Path

from cluster_client import chat, generate, stub_for

from deploy.procs import cmdline, processes
from engine.sampling_params import SamplingParams

REPO = Path(__file__).resolve().parents[2]
SBATCH = REPO / "deploy" / "slurm" / "pdserve.sbatch"
QUESTION = "What is the capital of France?"


def _job_procs(job: str) -> list[str]:
    """Processes of this job still alive: pdserve ones, srun steps, the driver."""
    left = []
    for p in processes():
        if p.state == "Z":
            continue
        try:
            with open(f"/proc/{p.pid}/environ", "rb") as f:
                env = f.read().split(b"\0")
        except OSError:
            continue
        if f"SLURM_JOB_ID={job}".encode() in env:
            left.append(f"{p.pid} {cmdline(p.pid)}")
    return left


def _stream_chat(http: str, content: str, max_tokens: int) -> str:
    body = json.dumps({"model": "smollm2", "stream": True, "temperature": 0,
                       "max_tokens": max_tokens,
                       "messages": [{"role": "user", "content": content}]}).encode()
    req = urllib.request.Request(f"{http}/v1/chat/completions", data=body,
                                 headers={"Content-Type": "application/json"})
    text, chunks = [], 0
    with urllib.request.urlopen(req, timeout=120) as resp:
        for raw in resp:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            delta = json.loads(line[6:])["choices"][0]["delta"]
            if delta.get("content"):
                text.append(delta["content"])
                chunks += 1
    assert chunks > 1, "not streamed"
    return "".join(text)


def test_sbatch_1p1d_serves_and_scancel_leaves_nothing(slurm, tmp_path: Path,  # type: ignore[no-untyped-def]
                                                       colocated_llm) -> None:
    env = {"PDSERVE_PRODUCER_NODES": "1", "PDSERVE_CONSUMER_NODES": "1",
           "PDSERVE_MODEL": "smollm2", "PDSERVE_TRANSFER_BACKEND": "ucx",
           "PDSERVE_WORKER_ARGS": "--threads 1 --kv-cache-mib 64",
           "PDSERVE_PYTHON": sys.executable}
    slurm.env.update(env)
    out = slurm.cmd("sbatch", "--parsable", "--nodes=3", str(SBATCH), cwd=tmp_path)
    job = out.strip().split(";")[0]
    log = tmp_path / f"pdserve-{job}.log"
    endpoint = tmp_path / f"pdserve-{job}.json"

    def context() -> str:
        job_out = log.read_text(errors="replace")[-6000:] if log.exists() else "(no log)"
        return f"job {job} output:\n{job_out}\n{slurm.logs()}"

    try:
        end = time.monotonic() + 300
        while not endpoint.exists():
            state = slurm.cmd("squeue", "-h", "-j", job, "-o", "%T", check=False).strip()
            assert state in ("PENDING", "RUNNING", "CONFIGURING"), \
                f"job state {state!r}\n{context()}"
            assert time.monotonic() < end, f"no endpoint file after 300 s\n{context()}"
            time.sleep(0.25)
        ep = json.loads(endpoint.read_text())
        assert set(ep) == {"grpc", "http", "producers", "consumers", "colocated"}, ep
        assert len(ep["producers"]) == 1 and len(ep["consumers"]) == 1, ep
        assert ep["colocated"] == [], ep  # PDSERVE_COLOCATED_NODES defaults to 0
        assert ep["http"].startswith("http://127.0.0.1:"), ep  # NodeAddr from scontrol

        llm = colocated_llm  # tests/conftest.py: the session's reference engine
        prompt = llm.tokenizer.encode_chat([{"role": "user", "content": QUESTION}])
        ref = llm.generate([prompt], [SamplingParams(max_tokens=16, temperature=0.0)])[0]
        assert _stream_chat(ep["http"], QUESTION, 16) == ref.text, context()
        ch, stub = stub_for(ep["grpc"])
        with ch:
            r = generate(stub, dict(max_tokens=16, temperature=0), **chat(QUESTION))
        assert r.error == "" and r.token_ids == ref.token_ids, (r.error, context())
        # every worker ran through srun on its node
        steps = slurm.cmd("squeue", "-h", "-s", "-j", job, "-o", "%j")
        assert "pdserve-worker-n2-0" in steps and "pdserve-worker-n3-0" in steps, steps
    finally:
        slurm.cmd("scancel", job, check=False)
    end = time.monotonic() + 90
    while _job_procs(job) or slurm.cmd("squeue", "-h", "-j", job, check=False).strip():
        assert time.monotonic() < end, \
            f"left after scancel: {_job_procs(job)}\n{context()}"
        time.sleep(0.5)
    assert not [p for p in processes() if os.path.exists(f"/proc/{p.pid}")
                and f"--router {ep['grpc']}" in cmdline(p.pid)], context()
